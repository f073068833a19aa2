"""bnsgcn: partition-parallel full-graph GNN training with random boundary node sampling.

The Python API (docs/api.md)::

    import bnsgcn
    parts = bnsgcn.partition(graph, 2, "parts/my-graph-2")     # a PartitionSet
    result = bnsgcn.train(parts, procs=2, epochs=50, p=0.1)    # a Result: model, metrics, scores
    out = bnsgcn.predict(result.run_dir)                       # logits and predictions of every node
    model = bnsgcn.export(result.run_dir)                      # a plain torch module: model(x, edge_index)

``partition`` is the partition step's package, callable (:func:`bnsgcn.partition.api.partition`);
``train`` is :func:`bnsgcn.launch.api.train`, ``predict`` :func:`bnsgcn.launch.predict.predict`,
``export`` :func:`bnsgcn.run.export.export`. They, and the classes they return, are
imported on first use: ``import bnsgcn`` loads neither torch nor the partition step.
"""

from bnsgcn.errors import UserError

__version__ = "0.1.0"
__all__ = ["PartitionSet", "Result", "TrainConfig", "UserError", "export", "partition", "predict", "train"]


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
    if name == "predict":
        from bnsgcn.launch.predict import predict

        return predict
    if name == "export":
        from bnsgcn.run.export import export

        return export
    if name == "TrainConfig":
        from bnsgcn.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'bnsgcn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
