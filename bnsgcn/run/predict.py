"""A finished run's model over every node, on the ranks of its partition set (``bnsgcn-predict``).

Each rank loads its partition and the run's ``best_model.pt`` and runs evaluation's forward
pass (every boundary row, p = 1, in column slices: :class:`bnsgcn.run.evaluate.Evaluation`);
rank 0 gathers every rank's rows with their global node ids and writes them in node order
(row ``v`` is node ``v`` of the dataset, whatever the partitions' own orders).

What is written (docs/cli.md): the logits [N, C] and predictions, or with ``embeddings=K``
the output of layer ``K`` (0-based; before the norm and activation that follow it, with its
bias: the last layer's output is the logits). ``.pt``: one dict of tensors, ``node_ids``
int64 [N] and either ``logits`` float32 [N, C] and ``predictions`` (int64 [N] classes, or
uint8 [N, C] 0/1 for a multi-label dataset: logit > 0) or ``embeddings`` float32 [N, D].
``.npy``: the logits (or embeddings) array itself, and the predictions next to it in
``<name>.predictions.npy``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from bnsgcn import files
from bnsgcn.comm.communicator import init_from_env
from bnsgcn.config import TrainConfig
from bnsgcn.data.format import feature_preprocessing, load_partition, read_manifest
from bnsgcn.data.shard import load_shard
from bnsgcn.errors import UserError, failure_line
from bnsgcn.exchange import resolve_exchange_settings
from bnsgcn.nn.model import GNN, build_model
from bnsgcn.run.evaluate import Evaluation
from bnsgcn.run.inference import MODEL_FILE, run_config

SUFFIXES = (".pt", ".npy")
DEFAULT_OUT = "predictions.pt"  # in the run directory


def trained_on(manifest: dict) -> dict:
    """What config.json records of the partition set a run trained on: its set id (None for a
    set without one) and its features' preprocessing (``bnsgcn.export`` redoes it)."""
    return {"partition_set": manifest.get("set_id"), "feature_preprocessing": feature_preprocessing(manifest)}


def predictions_sibling(out: Path) -> Path:
    """Where the predictions of a ``.npy`` output go: ``<name>.predictions.npy`` next to it."""
    return out.with_name(out.name.removesuffix(".npy") + ".predictions.npy")


@dataclass(frozen=True)
class PredictRequest:
    """What to predict: the run, the output file, and the layer whose output to write (None:
    the logits and predictions)."""

    run_dir: Path
    out: Path
    embeddings: int | None = None

    def to_json(self) -> str:
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> PredictRequest:
        values = json.loads(text)
        return cls(Path(values["run_dir"]), Path(values["out"]), values["embeddings"])


def check_request(
    run_dir: Path, out: Path | None = None, embeddings: int | None = None, parts_dir: Path | None = None
) -> tuple[TrainConfig, PredictRequest]:
    """Everything that can be checked before ranks start: the run's configuration (with
    ``parts_dir`` when given) and the request. Raises :class:`UserError` with one line."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass the run directory of a finished bnsgcn-train run")
    config = run_config(run_dir)
    if not (run_dir / MODEL_FILE).is_file():
        raise UserError(f"{run_dir / MODEL_FILE} is missing: the run did not finish an evaluation; train it to the end")
    out = run_dir / DEFAULT_OUT if out is None else Path(out)
    if out.suffix not in SUFFIXES:
        raise UserError(f"--out {out} has the unknown suffix {out.suffix or '(none)'!r}; name a .pt or .npy file")
    layers = config.model.layers
    if embeddings is not None and not config.model.builtin:
        raise UserError(
            f"--embeddings reads a layer of the built-in models; {config.model.name} is a model of your own: predict "
            "its logits, or compute the layer's output with bnsgcn.export(run_dir) and a forward hook of your own"
        )
    if embeddings is not None and not 0 <= embeddings < layers:
        raise UserError(
            f"--embeddings {embeddings} is out of range: the model has {layers} layers; pass 0 to {layers - 1}"
        )
    if parts_dir is not None:
        config = config.replace(parts_dir=Path(parts_dir))
    if config.data.parts_dir is None:
        raise UserError(f"{run_dir / 'config.json'} names no partition set; pass --parts-dir")
    check_partition_set(run_dir, config)
    return config, PredictRequest(run_dir, out, embeddings)


def check_partition_set(run_dir: Path, config: TrainConfig) -> None:
    """The partition set is the one the run trained on: its recorded set id (where recorded)
    and the model's shapes (feature and class counts)."""
    parts_dir = config.data.parts_dir
    manifest = read_manifest(parts_dir)
    recorded = json.loads((run_dir / "config.json").read_text()).get("partition_set")
    if recorded is not None and manifest.get("set_id") != recorded:
        raise UserError(
            f"{parts_dir} no longer matches {run_dir} (set id {manifest.get('set_id')}, the run trained on "
            f"{recorded}); pass --parts-dir with the partition set the run trained on"
        )
    dataset = manifest["dataset"]
    model = build_model(config, dataset["num_features"], dataset["num_classes"], lambda t: t)
    try:
        model.load_state_dict(torch.load(run_dir / MODEL_FILE, map_location="cpu", weights_only=True))
    except (RuntimeError, ValueError, KeyError) as exc:
        lines = str(exc).strip().splitlines()
        detail = (lines[1] if len(lines) > 1 else lines[0]).strip().rstrip(".")
        raise UserError(
            f"{parts_dir} does not match the model of {run_dir} ({dataset['num_features']} features, "
            f"{dataset['num_classes']} classes: {detail}); pass --parts-dir with the partition set the run trained on"
        ) from None


def layer_output(model: GNN, layer: int) -> tuple[list[Tensor], torch.utils.hooks.RemovableHandle]:
    """A list that receives the output of ``model.layers[layer]`` at each forward pass, with
    its bias even where the model leaves that to the norm after it (``bias_in_norm``)."""
    outputs: list[Tensor] = []
    add_bias = model.bias_in_norm[layer]

    def keep(module: torch.nn.Module, inputs: tuple, output: Tensor) -> None:
        outputs.append(output + module.output_bias if add_bias else output)

    return outputs, model.layers[layer].register_forward_hook(keep)


def run(config: TrainConfig, request: PredictRequest) -> dict[str, Tensor] | None:
    """One rank of a prediction job (the environment as for training, see
    :func:`bnsgcn.comm.communicator.init_from_env`): rank 0 writes ``request.out`` and returns
    what it wrote; the other ranks return None."""
    # the rank's setup as training does it; imported here, as training's rank imports this module
    from bnsgcn.run.train import compile_kernels, graph_inputs

    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    comm = init_from_env(config.run.device, config.run.timeout, ranks_per_gpu=config.run.ranks_per_gpu)
    try:
        compile_kernels(comm)
        config = resolve_exchange_settings(config, comm)
        shard = load_shard(config.data.parts_dir, comm.rank, comm.world_size, verify=config.data.verify)
        shard = shard.to(comm.device)
        inputs = graph_inputs(config, comm, shard, shard.topology, shard.features, shard.labels, shard.train_mask)
        model = build_model(config, shard.features.shape[1], shard.num_classes, lambda t: comm.all_reduce(t))
        state = torch.load(request.run_dir / MODEL_FILE, map_location=comm.device, weights_only=True)
        model.to(comm.device).load_state_dict(state)
        model.eval()
        kept, hook = layer_output(model, request.embeddings) if request.embeddings is not None else (None, None)
        evaluation = Evaluation(comm, config.evaluation.buffer_bytes)
        rows = evaluation.logits(model, inputs.graph, inputs.planner.full(), inputs.features, inputs.x_agg)
        if hook is not None:
            hook.remove()
            rows = kept[-1]
        node_ids = load_partition(config.data.parts_dir, comm.rank)["inner_nodes"]
        gathered = comm.gather_object((np.asarray(node_ids), rows.cpu().numpy()))
        written = None
        if comm.rank == 0:
            dataset = shard.manifest["dataset"]
            written = node_order(gathered, dataset["num_nodes"], request.embeddings, dataset.get("multilabel", False))
            write(request.out, written)
        comm.barrier()  # the job ends when the file is in place
    except Exception as exc:  # this rank is the cause: tell the others, as a training rank does
        comm.report_failure(failure_line(exc))
        raise
    comm.close()
    return written


def node_order(
    gathered: list[tuple[np.ndarray, np.ndarray]], num_nodes: int, embeddings: int | None, multilabel: bool
) -> dict[str, Tensor]:
    """Every rank's ``(global ids, rows)`` as the tensors written, row ``v`` for node ``v``."""
    width = gathered[0][1].shape[1]
    values = torch.zeros((num_nodes, width), dtype=torch.float32)
    for ids, rows in gathered:
        values[torch.from_numpy(ids)] = torch.from_numpy(rows)
    node_ids = torch.arange(num_nodes, dtype=torch.int64)
    if embeddings is not None:
        return {"node_ids": node_ids, "embeddings": values}
    predictions = (values > 0).to(torch.uint8) if multilabel else values.argmax(1)
    return {"node_ids": node_ids, "logits": values, "predictions": predictions}


def write(out: Path, arrays: dict[str, Tensor]) -> None:
    """Write ``arrays`` to ``out`` in the format of its suffix, each file whole."""
    if out.suffix == ".pt":
        with files.atomic(out) as sink:
            torch.save(arrays, sink)
        return
    main = arrays["embeddings"] if "embeddings" in arrays else arrays["logits"]
    with files.atomic(out) as sink:
        np.save(sink, main.numpy())
    if "predictions" in arrays:
        with files.atomic(predictions_sibling(out)) as sink:
            np.save(sink, arrays["predictions"].numpy())


def read(out: Path, embeddings: bool) -> dict[str, Tensor]:
    """What :func:`write` wrote to ``out``, as the ``.pt`` dict holds it."""
    if out.suffix == ".pt":
        return torch.load(out, map_location="cpu", weights_only=True)
    main = torch.from_numpy(np.load(out))
    arrays = {"node_ids": torch.arange(main.shape[0], dtype=torch.int64)}
    if embeddings:
        return arrays | {"embeddings": main}
    return arrays | {"logits": main, "predictions": torch.from_numpy(np.load(predictions_sibling(out)))}
