#!/usr/bin/env bash
# Create .venv, install bnsgcn, partition the built-in synthetic graph and train on it
# with 2 CPU ranks. Override the torch requirement with BNSGCN_TORCH (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install -q "${BNSGCN_TORCH:-torch==2.13.0}"
.venv/bin/pip install -q -e ".[test,plots]"  # plots: the demo run draws its report figures
.venv/bin/bnsgcn-partition --parts 2 synthetic
.venv/bin/bnsgcn-train --procs 2 --p 0.1 --epochs 50 --eval-every 10
