#!/usr/bin/env bash
# Create .venv, install bnsgcn, partition the built-in synthetic graph and train on it
# with 2 CPU ranks. Override the torch requirement with BNSGCN_TORCH (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
step() { printf '\n==> %s\n' "$*"; }
step "creating the virtual environment .venv"
python3 -m venv .venv
step "installing ${BNSGCN_TORCH:-torch==2.13.0} (the CPU build is about 200 MB to download; a CUDA build several GB)"
.venv/bin/pip install --progress-bar on "${BNSGCN_TORCH:-torch==2.13.0}"
step "installing bnsgcn and its dependencies (pymetis, ogb, numba, pandas; for the tests pytest, TensorBoard, W&B and PyG; matplotlib for the figures)"
.venv/bin/pip install --progress-bar on -e ".[test,plots]"
step "partitioning the built-in synthetic graph into 2 parts"
.venv/bin/bnsgcn-partition --parts 2 synthetic
step "training on it with 2 CPU ranks"
.venv/bin/bnsgcn-train --procs 2 --p 0.1 --epochs 50 --eval-every 10
