"""The flags of the original BNS-GCN (github.com/GATECH-EIC/BNS-GCN, ``helper/parser.py``), as
bnsgcn-train and bnsgcn-partition take them, so that its commands carry over.

Each command takes each of the original's flags in one of these ways (docs/migrating.md has
the whole table, with the defaults that differ):

* ``SAME``: bnsgcn's own flag of that name means the same;
* ``ALIAS``: another name of one of bnsgcn's flags (``--sampling-rate`` is ``--p``), or of one
  value of it (``--no-eval`` is ``--eval-every 0``);
* ``OWN``: a value the command resolves itself (``--n-partitions`` of bnsgcn-train: the job's
  ranks; ``--graph-name``: the partition set's directory name);
* ``IGNORED``: accepted, without effect: bnsgcn always does what it asks (``--fix-seed``);
* ``REFUSED``: one line naming bnsgcn's way, where accepting it would mislead (``--backend``).

A flag of the original that a command does not take at all belongs to the other command: the
error says so (:func:`elsewhere`). The aliases stay out of ``--help``; its epilog names them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bnsgcn.cli import Ignored, Refused

SAME, ALIAS, OWN, IGNORED, REFUSED = "same", "alias", "own", "ignored", "refused"
TRAIN, LAUNCH, PARTITION = "training", "launch", "partition"  # where a command registers a flag
COMMANDS = {TRAIN: "bnsgcn-train", LAUNCH: "bnsgcn-train", PARTITION: "bnsgcn-partition"}

# Every flag of the original's parser, in its order (the underscore forms it also takes,
# --n_epochs, are every bnsgcn flag's too). The last three are an earlier version's, still
# passed by its multi-node script.
ORIGINAL_FLAGS = (
    "--dataset",
    "--data-path",
    "--part-path",
    "--graph-name",
    "--model",
    "--dropout",
    "--lr",
    "--sampling-rate",
    "--heads",
    "--n-epochs",
    "--n-partitions",
    "--n-hidden",
    "--n-layers",
    "--log-every",
    "--weight-decay",
    "--norm",
    "--partition-obj",
    "--partition-method",
    "--n-linear",
    "--use-pp",
    "--inductive",
    "--fix-seed",
    "--seed",
    "--backend",
    "--port",
    "--master-addr",
    "--node-rank",
    "--parts-per-node",
    "--skip-partition",
    "--eval",
    "--no-eval",
    "--n-feat",
    "--n-class",
    "--n-train",
)


@dataclass(frozen=True)
class Handling:
    """How one command takes one of the original's flags (see the module)."""

    kind: str
    native: str = ""  # ALIAS: bnsgcn's flag it names
    const: object = None  # ALIAS of one value of ``native`` (a flag without a value)
    dest: str = ""  # OWN: the attribute the command resolves
    value_type: type = str  # OWN
    takes_value: bool = True  # IGNORED, REFUSED
    why: str = ""  # REFUSED: the problem and bnsgcn's way
    allowed: tuple[str, ...] = ()  # REFUSED: values that mean what bnsgcn does and pass


def _same() -> Handling:
    return Handling(SAME)


TRAINING_FLAGS: dict[str, Handling] = {
    "--model": _same(),
    "--dropout": _same(),
    "--lr": _same(),
    "--heads": _same(),
    "--weight-decay": _same(),
    "--norm": _same(),
    "--seed": _same(),
    "--inductive": _same(),
    "--sampling-rate": Handling(ALIAS, "--p"),
    "--n-epochs": Handling(ALIAS, "--epochs"),
    "--n-hidden": Handling(ALIAS, "--hidden"),
    "--n-layers": Handling(ALIAS, "--layers"),
    "--log-every": Handling(ALIAS, "--eval-every"),  # the original evaluates and logs every N epochs
    "--use-pp": Handling(ALIAS, "--precompute", const=True),
    "--no-eval": Handling(ALIAS, "--eval-every", const=0),
    "--eval": Handling(IGNORED, takes_value=False),  # the original's default
    "--fix-seed": Handling(IGNORED, takes_value=False),  # every bnsgcn run is seeded by --seed
    "--skip-partition": Handling(IGNORED, takes_value=False),  # bnsgcn-train never partitions
    # the original overwrites these with the partition's own counts; bnsgcn reads them from the set
    "--n-feat": Handling(IGNORED),
    "--n-class": Handling(IGNORED),
    "--n-train": Handling(IGNORED),
    "--n-linear": Handling(
        REFUSED,
        why="bnsgcn's models have no linear layers after the GNN layers; drop it (--layers counts GNN layers)",
        allowed=("0",),
    ),
    "--backend": Handling(
        REFUSED,
        why="bnsgcn-train picks the backend from the device; drop it and pass --gpus N (NCCL) or --procs N (gloo)",
    ),
    "--data-path": Handling(
        REFUSED,
        why="bnsgcn-train reads a partition set, not the dataset; pass --data-dir to bnsgcn-partition and "
        "--parts-dir (or nothing: the one set found) here",
    ),
}

LAUNCH_FLAGS: dict[str, Handling] = {
    "--master-addr": _same(),
    "--node-rank": _same(),
    "--port": Handling(ALIAS, "--master-port"),
    "--n-partitions": Handling(OWN, dest="n_partitions", value_type=int),
    "--dataset": Handling(OWN, dest="dataset"),
    "--part-path": Handling(OWN, dest="part_path", value_type=Path),
    "--graph-name": Handling(OWN, dest="graph_name"),
    "--parts-per-node": Handling(
        REFUSED, why="pass --gpus N (or --procs N), the ranks on each machine, with --nnodes M, the machines"
    ),
}

PARTITION_FLAGS: dict[str, Handling] = {
    "--seed": _same(),
    "--dataset": Handling(OWN, dest="dataset_option"),
    "--data-path": Handling(ALIAS, "--data-dir"),
    "--n-partitions": Handling(ALIAS, "--parts"),
    "--partition-method": Handling(ALIAS, "--method"),
    "--partition-obj": Handling(ALIAS, "--objective"),
    "--part-path": Handling(OWN, dest="part_path", value_type=Path),
    "--graph-name": Handling(OWN, dest="graph_name"),
    "--inductive": Handling(
        REFUSED,
        takes_value=False,
        why="a partition set holds the whole graph; drop it here and pass --inductive to bnsgcn-train",
    ),
}

TABLES = {TRAIN: TRAINING_FLAGS, LAUNCH: LAUNCH_FLAGS, PARTITION: PARTITION_FLAGS}


def add_original_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, where: str) -> None:
    """Register the original's flags that ``where`` (TRAIN, LAUNCH or PARTITION) takes, out of
    ``--help``; bnsgcn's own flags must be registered first (an alias copies its flag)."""
    for flag, how in TABLES[where].items():
        hidden = {"help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
        if how.kind == ALIAS:
            native = parser._option_string_actions[how.native]
            if how.const is not None:
                parser.add_argument(flag, dest=native.dest, action="store_const", const=how.const, **hidden)
            else:  # the same conversion and choices as bnsgcn's flag: only the name differs
                parser.add_argument(
                    flag, dest=native.dest, type=native.type, choices=native.choices, metavar=native.metavar, **hidden
                )
        elif how.kind == OWN:
            parser.add_argument(flag, dest=how.dest, type=how.value_type, help=argparse.SUPPRESS)
        elif how.kind == IGNORED:
            parser.add_argument(flag, action=Ignored, nargs=None if how.takes_value else 0, **hidden)
        elif how.kind == REFUSED:
            parser.add_argument(
                flag,
                action=Refused,
                why=how.why,
                allowed=how.allowed,
                nargs=None if how.takes_value else 0,
                **hidden,
            )


def elsewhere(command: str):
    """For ``command`` ("bnsgcn-train" or "bnsgcn-partition"): a function from a flag it does
    not take to the fix that names the command that does (None for any other flag)."""

    def fix(flag: str) -> str | None:
        for where, table in TABLES.items():
            other = COMMANDS[where]
            if other == command or flag not in table:
                continue
            how = table[flag]
            if how.kind == REFUSED:
                return None
            meaning = f" (as {how.native})" if how.kind == ALIAS else ""
            return f"it is a flag of {other}: pass it there{meaning}"
        return None

    return fix


def aliases_epilog(*wheres: str, example: str = "--master_addr") -> str:
    """The one paragraph at the end of ``--help`` that names the original's flags a command
    takes for bnsgcn's (the aliases stay off the flags' list)."""
    flags = sorted(f for w in wheres for f, how in TABLES[w].items() if how.kind in (ALIAS, OWN))
    return (
        f"Every flag may also be written with underscores ({example}). The original BNS-GCN's flags "
        f"{', '.join(flags)} are accepted too, and its others ignored or refused: see docs/migrating.md."
    )
