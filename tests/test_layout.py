"""The package layout: one import namespace, and data flowing one way.

The repository keeps the design's folders (``bnsgcn/`` the engine, ``partition/`` the
offline step, ``launch/`` the launcher), installed as ``bnsgcn``, ``bnsgcn.partition`` and
``bnsgcn.launch``. The engine never imports the other two, with one exception: the package's
root module, ``bnsgcn/__init__.py``, is the Python API's face (``bnsgcn.partition``,
``bnsgcn.train``) and names the other two inside functions only, so that importing the
engine, or any part of it, loads neither. Inside the engine, each stage of
an epoch is a sub-package, and a stage imports only the stages before it in the flow
(data -> comm -> exchange -> nn -> sync -> run) and the foundations every stage uses
(errors, device, files, cli, config, kernels, metrics), which import no stage. The tests share their
helpers through ``tests/helpers/``: no test file imports another.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "bnsgcn"
FORBIDDEN = ("partition", "launch")
FOUNDATIONS = {"errors": set(), "device": set(), "files": {"errors"}, "cli": {"errors"}}
FOUNDATIONS |= {"config": {"errors", "device", "cli"}, "kernels": {"errors"}, "metrics": {"errors", "files", "cli"}}
STAGES = ("data", "comm", "exchange", "nn", "sync", "run")  # the order data flows in an epoch


def _imported_modules(path: Path, root: Path | None = None, at_import: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved
    against the module's place in the ``bnsgcn`` package; with ``at_import`` only those that
    run when the module is imported (not those inside a function's body)."""
    package = ["bnsgcn", *path.relative_to(root or ENGINE).parent.parts]
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path)), at_import):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            # `from . import partition` names the subpackage in the alias
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _runtime_nodes(tree: ast.AST, at_import: bool = False):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (hints only: no import
    at run time), and with ``at_import`` those inside a function's body."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            children = node.orelse
        elif at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:
            children = [node]
        for child in children:
            yield child
            yield from _runtime_nodes(child, at_import)


def _engine_imports_of_other_steps(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        # the root module may name them in a function (the Python API, loaded on use)
        for line, module in _imported_modules(path, root, at_import=path == root / "__init__.py"):
            parts = module.split(".")
            if parts[0] in FORBIDDEN or (parts[0] == "bnsgcn" and len(parts) > 1 and parts[1] in FORBIDDEN):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return bad


def test_engine_imports_neither_the_partition_step_nor_the_launcher():
    assert _engine_imports_of_other_steps(ENGINE) == []


def _allowed_stages(stage: str) -> set[str]:
    """The engine's top-level parts a module of ``stage`` may import besides its own."""
    if stage in FOUNDATIONS:
        return FOUNDATIONS[stage]
    return set(FOUNDATIONS) | set(STAGES[: STAGES.index(stage)])


def _imports_against_the_flow(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        stage = path.relative_to(root).parts[0].removesuffix(".py")
        if stage == "__init__":
            continue
        assert stage in FOUNDATIONS or stage in STAGES, f"{path}: a part of the engine no rule names"
        for line, module in _imported_modules(path, root):
            parts = module.split(".")
            if parts[0] != "bnsgcn" or len(parts) < 2 or parts[1] in (stage, *FORBIDDEN):
                continue
            where = f"{path.relative_to(root.parent)}:{line} "
            if parts[1] not in _allowed_stages(stage) and not (bad and bad[-1].startswith(where)):
                bad.append(f"{where}({stage}) imports {module}")
    return bad


def test_each_stage_imports_only_the_stages_before_it():
    assert _imports_against_the_flow(ENGINE) == []


@pytest.mark.parametrize(
    "module, line",
    [
        ("nn/model.py", "from bnsgcn.run.train import run"),
        ("nn/layers.py", "import bnsgcn.sync.reducer"),
        ("data/shard.py", "from bnsgcn.comm import plan"),
        ("exchange/stale.py", "from bnsgcn.nn.graph import EpochGraph"),
        ("metrics/report.py", "from bnsgcn.data.format import read_manifest"),
        ("kernels/spmm.py", "from bnsgcn.config import TrainConfig"),
        ("nn/graph.py", "from bnsgcn import run"),
    ],
)
def test_the_flow_check_catches_each_backward_import(tmp_path, module, line):
    engine = tmp_path / "bnsgcn"
    (engine / module).parent.mkdir(parents=True)
    (engine / module).write_text("import torch\n" + line + "\nif TYPE_CHECKING:\n    from bnsgcn.run import train\n")
    (found,) = _imports_against_the_flow(engine)
    assert found.startswith(f"bnsgcn/{module}:2 ")


def test_hint_only_imports_are_not_runtime_imports(tmp_path):
    engine = tmp_path / "bnsgcn"
    (engine / "metrics").mkdir(parents=True)
    (engine / "metrics" / "accounting.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bnsgcn.comm.communicator import Comm\n"
    )
    assert _imports_against_the_flow(engine) == []


@pytest.mark.parametrize(
    "module, line",
    [
        ("train.py", "from bnsgcn.partition.graph import Graph"),
        ("train.py", "import bnsgcn.launch.cli"),
        ("train.py", "from .launch import rank"),
        ("train.py", "from . import partition"),
        ("kernels/spmm.py", "from ..partition import writer"),
        ("kernels/spmm.py", "import partition.writer"),
    ],
)
def test_the_import_check_catches_each_form(tmp_path, monkeypatch, module, line):
    # the check itself must be able to fail: a fake engine module with one bad import
    engine = tmp_path / "bnsgcn"
    (engine / "kernels").mkdir(parents=True)
    (engine / module).write_text("import torch\n" + line + "\n")
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", engine)
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (found, *_) = _engine_imports_of_other_steps(engine)
    assert found.startswith(f"bnsgcn/{module}:2 imports ")


@pytest.mark.parametrize(
    "text, flagged",
    [
        ("import bnsgcn.partition\n", True),
        ("from bnsgcn.launch.api import train\n", True),
        ("if True:\n    from .partition import api\n", True),
        ("def __getattr__(name):\n    import bnsgcn.partition\n    return bnsgcn.partition\n", False),
        ("def __getattr__(name):\n    from bnsgcn.launch import api\n    return api.train\n", False),
        ("class Lazy:\n    def load(self):\n        from .launch import api\n", False),
    ],
)
def test_the_root_module_reaches_the_other_steps_only_in_functions(tmp_path, monkeypatch, text, flagged):
    # the exception is the root module's, and only for imports that run on use
    engine = tmp_path / "bnsgcn"
    (engine / "kernels").mkdir(parents=True)
    (engine / "__init__.py").write_text(text)
    (engine / "kernels" / "spmm.py").write_text("def f():\n    from bnsgcn.launch import api\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    found = _engine_imports_of_other_steps(engine)
    assert found[-1].startswith("bnsgcn/kernels/spmm.py:2 imports bnsgcn.launch")  # elsewhere: never
    assert any(line.startswith("bnsgcn/__init__.py:") for line in found) == flagged, found


def test_no_generic_top_level_names_outside_the_repository(tmp_path):
    # Run from elsewhere so that the repository root is not on sys.path: what resolves
    # is what the installation provides.
    code = (
        "import importlib.util as u, bnsgcn.partition.cli, bnsgcn.launch.rank;"
        "print(u.find_spec('partition'), u.find_spec('launch'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]


def test_the_wheel_installs_only_the_bnsgcn_name(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("bnsgcn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"bnsgcn"}
    for module in (
        "bnsgcn/partition/cli.py",
        "bnsgcn/partition/datasets/reddit.py",
        "bnsgcn/launch/rank.py",
        "bnsgcn/kernels/spmm.py",
    ):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "bnsgcn.partition.cli:main" in text and "bnsgcn.launch.cli:entry" in text


# --- the tests: no test file imports another; shared helpers live in tests/helpers/ ----------------

TESTS = REPO / "tests"


def _imports_of_test_modules(root: Path) -> list[str]:
    """``path:line imports module`` for every import, in a ``test_*.py`` file anywhere under
    ``root`` (the tests package), of a test module: one named ``test_*`` in the package (by
    absolute or relative name, or as ``from <package> import test_x``), or a bare ``test_*``
    module (a sibling, where the tests directory is on sys.path)."""
    bad = []
    for path in sorted(root.rglob("test_*.py")):
        package = [root.name, *path.relative_to(root).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                modules = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                inside = parts[0] == root.name and any(part.startswith("test_") for part in parts[1:])
                if inside or parts[0].startswith("test_"):
                    bad.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {module}")
                    break
    return bad


def test_no_test_file_imports_another():
    assert _imports_of_test_modules(TESTS) == []


@pytest.mark.parametrize(
    "module, line",
    [
        ("test_a.py", "from .test_b import helper"),
        ("test_a.py", "from . import test_b"),
        ("test_a.py", "from tests.test_b import helper"),
        ("test_a.py", "import tests.test_b"),
        ("test_a.py", "from tests import test_b"),
        ("test_a.py", "import test_b"),
        ("benchmarks/test_c.py", "from ..test_b import helper"),
        ("benchmarks/test_c.py", "from ...tests.test_b import helper"),
        ("test_a.py", "def f():\n    from .test_b import helper"),
    ],
)
def test_the_test_import_check_catches_each_form(tmp_path, module, line):
    # the check itself must be able to fail: a fake tests package with one import of a test module
    tests = tmp_path / "tests"
    (tests / "helpers").mkdir(parents=True)
    (tests / "benchmarks").mkdir()
    for name in ("__init__.py", "helpers/__init__.py", "benchmarks/__init__.py", "test_b.py"):
        (tests / name).write_text("")
    good = "import numpy\nfrom .helpers import graphs\nfrom tests.helpers.ranks import run_ranks\n"
    (tests / "test_good.py").write_text(good + "from bnsgcn.testing import test_x\n")
    (tests / module).write_text(good + line + "\n")
    (found,) = _imports_of_test_modules(tests)
    assert found.startswith(f"tests/{module}:{4 + line.count(chr(10))} imports ")
