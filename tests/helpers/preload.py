"""Imported once by the forkserver that forks every rank of ``run_ranks``.

The engine's imports (torch among them) and numba's compiler set-up take about 4 s of CPU
per process; paid here, once per test session, they are not paid again by each rank (on
two cores, four ranks spent about 8 s of each run starting). Nothing started here may be a
thread that a fork would leave behind: no kernel runs, so numba's threading layer is not
launched.
"""

import numba
import numpy as np

import bnsgcn.run.train  # noqa: F401  (the import is the point)


@numba.njit
def _sum(values: np.ndarray) -> float:
    return values.sum()


_sum(np.zeros(1))  # the first compilation builds numba's CPU target (registries, BLAS check)
