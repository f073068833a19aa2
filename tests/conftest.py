"""Session set-up shared by every test file (helpers live in tests/helpers/)."""

import pytest

from .helpers import kernels


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiling():
    """Start compiling the engine's CPU kernels into numba's cache, in the background, once
    per test run (helpers.kernels): the tests that start training jobs wait for it."""
    kernels.start_compiling()
