"""bnsgcn: partition-parallel full-graph GNN training with random boundary node sampling.

The Python API (docs/api.md)::

    import bnsgcn
    parts = bnsgcn.partition(graph, 2, "parts/my-graph-2")     # a PartitionSet
    result = bnsgcn.train(parts, procs=2, epochs=50, p=0.1)    # a Result: model, metrics, scores

``partition`` is the partition step's package, callable (:func:`bnsgcn.partition.api.partition`);
``train`` is :func:`bnsgcn.launch.api.train`. Both, and the classes they return, are
imported on first use: ``import bnsgcn`` loads neither torch nor the partition step.
"""

from bnsgcn.errors import UserError

__version__ = "0.1.0"
__all__ = ["PartitionSet", "Result", "TrainConfig", "UserError", "partition", "train"]


def __getattr__(name: str) -> object:
    # The engine reaches the partition step and the launcher here only, and only on use
    # (tests/test_layout.py holds it to that).
    if name == "partition":
        import bnsgcn.partition

        return bnsgcn.partition
    if name == "PartitionSet":
        from bnsgcn.partition.api import PartitionSet

        return PartitionSet
    if name in ("train", "Result"):
        from bnsgcn.launch import api

        return getattr(api, name)
    if name == "TrainConfig":
        from bnsgcn.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'bnsgcn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
