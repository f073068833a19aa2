"""The flag conventions of the three commands (bnsgcn/cli.py) and the original BNS-GCN's flags
(bnsgcn/config/original.py, docs/migrating.md): every alias sets what bnsgcn's flag sets,
underscore forms, no abbreviations, did-you-mean, refusals in one line, plain help."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bnsgcn.config import TrainConfig, from_args
from bnsgcn.config.original import (
    ALIAS,
    IGNORED,
    LAUNCH,
    ORIGINAL_FLAGS,
    OWN,
    PARTITION,
    REFUSED,
    SAME,
    TABLES,
    TRAIN,
)
from bnsgcn.errors import UserError
from bnsgcn.launch import cli as train_cli
from bnsgcn.launch.rank import training_parser
from bnsgcn.metrics import report
from bnsgcn.partition import cli as partition_cli

from .helpers.cli import LAUNCH_VARIABLES
from .helpers.graphs import partition, random_graph

REPO = Path(__file__).resolve().parents[1]
MIGRATING = REPO / "docs" / "migrating.md"
ROLE_MARKUP = re.compile(r"``|:(func|mod|class|meth|data|attr|obj):`")


def _config(argv: list[str]) -> TrainConfig:
    return from_args(training_parser("bnsgcn-train").parse_args(argv))


def _usage_error(capsys, parse, argv: list[str]) -> str:
    """The one stderr line of a refused command line (exit status 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.fixture
def clean_environment():
    """os.environ without an enclosing launch's variables, restored afterwards."""
    saved = dict(os.environ)
    for name in LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _set(directory: Path, parts: int, dataset: str = "random") -> Path:
    graph = random_graph(num_nodes=10 * parts)
    graph.name = dataset  # the manifest's dataset spec
    return partition(graph, parts, directory)


# --- the original's training flags: the same configuration as bnsgcn's flags -----------------


@pytest.mark.parametrize(
    ("original", "native"),
    [
        (["--sampling-rate", "0.3"], ["--p", "0.3"]),
        (["--sampling_rate=0.3"], ["--p", "0.3"]),
        (["--n-epochs", "7"], ["--epochs", "7"]),
        (["--n_epochs", "7"], ["--epochs", "7"]),
        (["--n-hidden", "32"], ["--hidden", "32"]),
        (["--n-layers", "4"], ["--layers", "4"]),
        (["--use-pp"], ["--precompute"]),
        (["--log-every", "5"], ["--eval-every", "5"]),
        (["--no-eval"], ["--eval-every", "0"]),
        (["--log-every", "5", "--no-eval"], ["--eval-every", "0"]),
        (["--fix-seed", "--seed", "3"], ["--seed", "3"]),
    ],
)
def test_each_training_alias_sets_what_bnsgcns_flag_sets(original, native):
    assert _config(original) == _config(native) != TrainConfig()


@pytest.mark.parametrize(
    "original",
    [
        ["--eval"],
        ["--fix-seed"],
        ["--skip-partition"],
        ["--n-feat", "602", "--n-class", "41", "--n-train", "153431"],
        ["--n-linear", "0"],
    ],
)
def test_the_ignored_flags_change_nothing(original):
    assert _config(original) == TrainConfig()


def test_the_originals_reddit_script_trains_as_bnsgcns_own_flags():
    original = (
        "--dropout 0.5 --lr 0.01 --n-epochs 3000 --model graphsage --sampling-rate .1 --n-layers 4 --n-hidden 256 "
        "--log-every 10 --inductive --use-pp"
    ).split()
    native = (
        "--dropout 0.5 --lr 0.01 --epochs 3000 --model graphsage --p 0.1 --layers 4 --hidden 256 --eval-every 10 "
        "--inductive --precompute"
    ).split()
    config = _config(original)
    assert config == _config(native)
    assert (config.run.epochs, config.model.layers, config.model.hidden, config.exchange.p) == (3000, 4, 256, 0.1)


def test_port_is_the_master_port():
    parse = train_cli.build_parser().parse_args
    assert vars(parse(["--port", "18118"])) == vars(parse(["--master-port", "18118"]))
    assert parse(["--port", "18118"]).master_port == 18118


def _children(argv: list[str]):
    return train_cli.prepare_local_ranks(train_cli.build_parser().parse_args(argv), argv)


def _same_ranks(a, b) -> None:
    """Two launches start the same ranks with the same configuration (ports and the job's
    secret are drawn anew each time)."""
    drawn = ("MASTER_PORT", "BNSGCN_JOB_TOKEN")
    assert [c.rank for c in a] == [c.rank for c in b]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.env.items() if k not in drawn} == {k: v for k, v in y.env.items() if k not in drawn}
        assert _config(x.argv[3:]) == _config(y.argv[3:])


def test_n_partitions_is_the_jobs_ranks(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    _set(tmp_path / "parts" / "two", 2)
    _set(tmp_path / "parts" / "three", 3)
    _same_ranks(_children(["--n-partitions", "2", "--device", "cpu"]), _children(["--procs", "2"]))
    _same_ranks(_children(["--n_partitions", "3", "--device", "cpu"]), _children(["--procs", "3"]))
    _same_ranks(_children(["--n-partitions", "2", "--procs", "2"]), _children(["--procs", "2"]))
    with pytest.raises(UserError, match="--n-partitions 3 disagrees with 2 ranks"):
        _children(["--n-partitions", "3", "--procs", "2"])
    with pytest.raises(UserError, match="does not split evenly over --nnodes 2"):
        _children(["--n-partitions", "3", "--nnodes", "2", "--master-addr", "127.0.0.1"])


def test_dataset_picks_the_set_made_from_it(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    cora = _set(tmp_path / "parts" / "cora-2", 2, "cora")
    _set(tmp_path / "parts" / "pubmed-2", 2, "pubmed")
    with pytest.raises(UserError, match="2 partition sets with 2 parts"):
        _children(["--procs", "2"])
    _same_ranks(_children(["--procs", "2", "--dataset", "cora"]), _children(["--procs", "2", "--parts-dir", str(cora)]))
    _same_ranks(_children(["--procs", "2", "--dataset", "CORA"]), _children(["--procs", "2", "--parts-dir", str(cora)]))
    with pytest.raises(UserError, match="was made from cora, not --dataset pubmed"):
        _children(["--procs", "2", "--dataset", "pubmed", "--parts-dir", str(cora)])
    with pytest.raises(UserError, match="no partition set with 2 parts made from reddit"):
        _children(["--procs", "2", "--dataset", "reddit"])


def test_graph_name_and_part_path_name_the_set(tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "partition"
    two = _set(store / "reddit-2-metis-vol-trans", 2)
    in_parts = _set(tmp_path / "parts" / "mine", 2)
    named = ["--procs", "2", "--parts-dir", str(two)]
    _same_ranks(_children(["--procs", "2", "--part-path", str(store), "--graph-name", two.name]), _children(named))
    _same_ranks(_children(["--procs", "2", "--part_path", str(store)]), _children(named))  # the one set there
    _same_ranks(
        _children(["--procs", "2", "--graph-name", "mine"]), _children(["--procs", "2", "--parts-dir", str(in_parts)])
    )
    with pytest.raises(UserError, match="both name the partition set"):
        _children(["--procs", "2", "--graph-name", "mine", "--parts-dir", str(in_parts)])


# --- the original's partition flags ---------------------------------------------------------


def _partition_args(argv: list[str]) -> dict:
    return vars(partition_cli.settle(partition_cli.build_parser().parse_args(argv)))


@pytest.mark.parametrize(
    ("original", "native"),
    [
        (["--dataset", "cora"], ["cora"]),
        (["--dataset=cora", "cora"], ["cora"]),
        (["--data-path", "dataset"], ["--data-dir", "dataset"]),
        (["--data_path", "dataset"], ["--data-dir", "dataset"]),
        (["--n-partitions", "4"], ["--parts", "4"]),
        (["--partition-method", "random"], ["--method", "random"]),
        (["--partition_obj", "vol"], ["--objective", "vol"]),
        (["cora", "--part-path", "store"], ["cora", "--out", "store/cora-2"]),
        (["cora", "--graph-name", "g"], ["cora", "--out", "parts/g"]),
        (["cora", "--part-path", "store", "--graph_name", "g"], ["cora", "--out", "store/g"]),
    ],
)
def test_each_partition_alias_sets_what_bnsgcns_flag_sets(original, native):
    assert _partition_args(original) == _partition_args(native) != _partition_args([])


def test_partition_aliases_that_disagree_are_refused():
    with pytest.raises(UserError, match="DATASET cora and --dataset pubmed disagree"):
        _partition_args(["cora", "--dataset", "pubmed"])
    with pytest.raises(UserError, match="both name the set's directory"):
        _partition_args(["cora", "--out", "x", "--graph-name", "g"])


# --- refusals: one line naming bnsgcn's way -------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--backend", "nccl"], ["--backend nccl:", "--gpus N (NCCL)", "--procs N (gloo)"]),
        (["--parts-per-node", "10"], ["--parts-per-node 10:", "--nnodes M"]),
        (["--n-linear", "2"], ["--n-linear 2:", "no linear layers"]),
        (["--data-path", "./dataset/"], ["--data-path ./dataset/:", "--data-dir to bnsgcn-partition"]),
    ],
)
def test_train_refuses_what_would_mislead(capsys, argv, words):
    line = _usage_error(capsys, train_cli.build_parser().parse_args, argv)
    for word in words:
        assert word in line, line


def test_partition_refuses_inductive(capsys):
    line = _usage_error(capsys, partition_cli.main, ["cora", "--inductive"])
    assert "--inductive:" in line and "pass --inductive to bnsgcn-train" in line


# --- underscore forms, in all three commands -------------------------------------------------------


def test_underscore_forms_in_bnsgcn_train():
    parse = train_cli.build_parser().parse_args
    underscored = ["--master_addr", "10.0.0.1", "--checkpoint_every", "2", "--node_rank=1", "--nnodes", "2"]
    dashed = ["--master-addr", "10.0.0.1", "--checkpoint-every", "2", "--node-rank=1", "--nnodes", "2"]
    assert vars(parse(underscored)) == vars(parse(dashed))
    assert (parse(underscored).master_addr, parse(underscored).checkpoint_every) == ("10.0.0.1", 2)
    # the launcher's own flags never reach the ranks, in either form
    assert train_cli.training_argv(["--master_addr", "h", "--epochs", "2", "--node_rank=0"]) == ["--epochs", "2"]
    assert _config(["--eval_every", "3", "--weight_decay=0.1"]) == _config(["--eval-every", "3", "--weight-decay=0.1"])


def test_underscore_forms_in_bnsgcn_partition():
    underscored = ["cora", "--data_dir", "d", "--node_order", "ids", "--memory_limit", "8G", "--num_classes=9"]
    dashed = ["cora", "--data-dir", "d", "--node-order", "ids", "--memory-limit", "8G", "--num-classes=9"]
    assert _partition_args(underscored) == _partition_args(dashed) != _partition_args(["cora"])


def test_underscore_forms_in_bnsgcn_report():
    parse = report.build_parser().parse_args
    assert parse(["r", "--target_accuracy", "0.9"]).target_accuracy == 0.9
    assert vars(parse(["r", "--target_accuracy=0.9"])) == vars(parse(["r", "--target-accuracy", "0.9"]))


# --- no abbreviation, and did you mean ---------------------------------------------------------------


def test_bnsgcn_partition_refuses_abbreviations(capsys):
    line = _usage_error(capsys, partition_cli.main, ["--part", "4", "--meth", "random"])
    assert line == "error: unknown flag --part; did you mean --parts?"
    line = _usage_error(capsys, partition_cli.main, ["cora", "--meth", "random"])
    assert line == "error: unknown flag --meth; did you mean --method?"


def test_bnsgcn_train_refuses_abbreviations(capsys):
    assert (
        _usage_error(capsys, train_cli.main, ["--epoch", "3"]) == "error: unknown flag --epoch; did you mean --epochs?"
    )
    line = _usage_error(capsys, train_cli.main, ["--master-ad", "h"])
    assert line == "error: unknown flag --master-ad; did you mean --master-addr?"
    # the ranks' parser too: the launcher passes the training flags on unparsed
    line = _usage_error(capsys, training_parser("rank").parse_args, ["--hidd", "8"])
    assert line == "error: unknown flag --hidd; did you mean --hidden?"


def test_bnsgcn_report_refuses_abbreviations(capsys):
    line = _usage_error(capsys, report.main, ["run", "--fig"])
    assert line == "error: unknown flag --fig; did you mean --figures?"


def test_unknown_flags_name_the_nearest_one_or_the_other_command(capsys):
    assert (
        _usage_error(capsys, train_cli.main, ["--hiden", "8"]) == "error: unknown flag --hiden; did you mean --hidden?"
    )
    assert (
        _usage_error(capsys, train_cli.main, ["--chekpoint_every", "2"])
        == "error: unknown flag --chekpoint_every; did you mean --checkpoint-every?"
    )
    assert _usage_error(capsys, partition_cli.main, ["cora", "--sampling-rate", "0.1"]) == (
        "error: unknown flag --sampling-rate for bnsgcn-partition; it is a flag of bnsgcn-train: pass it there (as --p)"
    )
    assert _usage_error(capsys, train_cli.main, ["--partition-method", "random"]) == (
        "error: unknown flag --partition-method for bnsgcn-train; it is a flag of bnsgcn-partition: pass it there "
        "(as --method)"
    )
    assert (
        _usage_error(capsys, train_cli.main, ["--zzzz"])
        == "error: unknown flag --zzzz; see bnsgcn-train --help for the flags"
    )
    assert _usage_error(capsys, report.main, ["run", "--target-accuracy", "95"]).endswith(
        "pass a fraction, e.g. --target-accuracy 0.95 for 95%"
    )
    line = _usage_error(capsys, partition_cli.main, ["--parts", "four"])  # argparse's own: one line, with a fix
    assert "invalid int value: 'four'" in line and line.endswith("; see bnsgcn-partition --help")


# --- help: plain text, the aliases named once at its end ----------------------------------------------


@pytest.mark.parametrize(
    ("parser", "where"),
    [
        (train_cli.build_parser, (TRAIN, LAUNCH)),
        (partition_cli.build_parser, (PARTITION,)),
        (report.build_parser, ()),
    ],
    ids=["train", "partition", "report"],
)
def test_help_is_plain_and_keeps_the_aliases_out(parser, where):
    built = parser()
    text = built.format_help()
    assert not ROLE_MARKUP.search(text), ROLE_MARKUP.search(text)
    options = text.rpartition("\n\n")[0]  # all but the epilog
    assert "with underscores" in built.epilog and "docs/" in built.epilog
    assert re.findall(r"--[a-z-]*_[a-z_-]*", options) == []  # the underscore forms have no lines either
    for table in where:
        for flag, how in TABLES[table].items():
            if how.kind != SAME:
                assert not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", options), flag  # no line of its own
                if how.kind in (ALIAS, OWN):
                    assert flag in built.epilog, flag  # named once, at the end


def test_report_help_names_what_a_comparison_shows():
    parser = report.build_parser()
    for words in ("best validation score", "test score", "wall time", "--target-accuracy"):
        assert words in parser.description, words
    assert "--target-accuracy T" in parser.format_help()


# --- the tables against docs/migrating.md ----------------------------------------------------------


def _migrating_rows() -> dict[str, tuple[str, str]]:
    """original flag -> (the bnsgcn-partition cell, the bnsgcn-train cell)."""
    text = MIGRATING.read_text().split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) == 3 and (flag := re.match(r"`(--[a-z-]+)`", cells[0])):
            rows[flag.group(1)] = (cells[1], cells[2])
    return rows


def _expected_start(how) -> str | None:
    if how is None:
        return "not taken"
    if how.kind == ALIAS:
        value = "" if how.const in (None, True) else f" {how.const}"
        return f"= `{how.native}{value}`"
    return {SAME: "same", IGNORED: "ignored", REFUSED: "refused"}.get(how.kind)


def test_every_original_flag_is_mapped_in_the_code_and_the_docs():
    tables = [set(t) for t in TABLES.values()]
    assert set().union(*tables) == set(ORIGINAL_FLAGS), set(ORIGINAL_FLAGS) ^ set().union(*tables)
    rows = _migrating_rows()
    assert list(rows) == list(ORIGINAL_FLAGS)
    for flag, (partition_cell, train_cell) in rows.items():
        train_how = TABLES[TRAIN].get(flag) or TABLES[LAUNCH].get(flag)
        for cell, how in ((partition_cell, TABLES[PARTITION].get(flag)), (train_cell, train_how)):
            start = _expected_start(how)
            if start is None:  # resolved by the command: described in words
                assert cell and not cell.startswith(("not taken", "same", "ignored", "refused")), (flag, cell)
            else:
                assert cell.startswith(start), (flag, cell, start)


def test_readme_and_cli_docs_link_the_migration_guide():
    assert "(docs/migrating.md)" in (REPO / "README.md").read_text()
    assert "(migrating.md)" in (REPO / "docs" / "cli.md").read_text()
