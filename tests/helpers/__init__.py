"""What the test files share. A test file imports its helpers from here, never from another
test file (tests/test_layout.py checks it).

* :mod:`.graphs`: small graphs and partition sets (random, Cora by METIS, an island, communities);
* :mod:`.ranks`: N ranks of the engine run in-process (:func:`~.ranks.run_ranks`), free ports,
  a run's final score, an instrument that records gradients;
* :mod:`.preload`: what the forkserver of those ranks imports once;
* :mod:`.reference`: the dense single-process models, the ground truth of the exactness tests;
* :mod:`.user_models`: GIN and APPNP as a user writes them, against the public API alone;
* :mod:`.device_syncs`: an instrument that records the engine's host reads (device syncs) per site;
* :mod:`.cli`: the CLIs run as a user runs them, and checks of their one-line errors;
* :mod:`.faults`: training jobs started as processes, their ranks found, killed or stopped;
* :mod:`.partition_sets`: the partitioner tests' graphs and the invariants every partition set keeps.

Kept light: the forkserver imports this package before :mod:`.preload`.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
