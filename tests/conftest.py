"""Session set-up shared by every test file (helpers live in tests/helpers/)."""

import pytest

from .helpers import kernels


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiling():
    """Start compiling the engine's CPU kernels into numba's cache, in the background, once
    per test run (helpers.kernels): the tests that start training jobs wait for it."""
    kernels.start_compiling()


# The order the files start in, for pytest-xdist's --dist loadfile (which hands files out in
# collection order once its own reordering, by number of tests, is off). The longest file on
# two cores (measured with --durations) first; then, while the kernels compile, files that
# need no compiled kernels, so that the other worker does not wait; then the other long files,
# longest first, so that no long file is left running alone at the end.
START_ORDER = (
    "test_workpool.py",
    "test_launch.py",
    "test_partition_cli.py",
    "test_partition.py",
    "test_partition_coarse.py",
    "test_datasets.py",
    "test_settings.py",
    "test_optim.py",
    "test_sync.py",
    "test_operator_faults.py",
    "test_slurm.py",
    "test_roofline_bench.py",
    "test_stragglers_bench.py",
    "test_cora.py",
    "test_api.py",
    "test_faults.py",
    "test_kernels.py",
    "test_lag.py",
    "test_errors.py",
    "test_hierarchical.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(START_ORDER)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's order kept
