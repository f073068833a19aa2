"""One rank's shard of the graph: its partition's arrays as torch tensors.

The topology (:class:`Topology`) is kept apart from the node data (:class:`Shard`) so that
the subgraph induced by the training nodes (inductive mode) is the same kind of object,
derived with :meth:`Topology.induced`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bnsgcn.data.format import check_partition_values, load_partition
from bnsgcn.errors import UserError
from bnsgcn.kernels.adjacency import csr_problem


def segment_counts(mask: torch.Tensor, counts: list[int]) -> list[int]:
    """How many entries of ``mask`` are set in each consecutive segment of the given lengths."""
    bounds = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int64, device=mask.device)
    running = torch.cat([torch.zeros(1, dtype=torch.int64, device=mask.device), mask.long().cumsum(0)])
    return (running[bounds[1:]] - running[bounds[:-1]]).tolist()


@dataclass
class Topology:
    """In-edges of a rank's inner nodes, in local column numbering.

    Columns ``[0, n_inner)`` are inner nodes, ``[n_inner, n_inner + n_boundary)`` boundary
    nodes grouped by owner rank (``boundary_counts[q]`` of them owned by rank q).
    ``send_nodes`` lists, grouped by requesting rank (``send_counts[q]`` for rank q), the
    inner rows that rank may request, in the order of its boundary nodes.

    Shapes: ``indptr`` int64 [n_inner+1], ``indices`` int32 [nnz] (as the partition
    format stores them), ``degree`` float32
    [n_inner + n_boundary] (in-degree of the graph this topology belongs to, self-loop
    included), ``send_nodes`` int64 [sum(send_counts)].
    """

    n_inner: int
    indptr: torch.Tensor
    indices: torch.Tensor
    degree: torch.Tensor
    boundary_counts: list[int]
    send_nodes: torch.Tensor
    send_counts: list[int]

    @property
    def n_boundary(self) -> int:
        return sum(self.boundary_counts)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    def induced(self, keep_inner: torch.Tensor, keep_boundary: torch.Tensor, keep_send: torch.Tensor) -> Topology:
        """The subgraph induced by the kept nodes, renumbered.

        Degrees of kept inner nodes are recounted from the kept edges; boundary degrees
        are set to 0 and must be filled in from their owners (see
        :func:`bnsgcn.comm.plan.fetch_boundary`). ``keep_send`` [sum(send_counts)] marks
        the send entries whose node the requesting rank keeps (i.e. ``keep_inner`` of
        the sent row, since inner nodes are kept on the owner's decision).
        """
        keep_column = torch.cat([keep_inner, keep_boundary])
        new_column = keep_column.long().cumsum(0) - 1
        rows = torch.repeat_interleave(torch.arange(self.n_inner), self.indptr.diff())
        keep_edge = keep_inner[rows] & keep_column[self.indices]
        n_inner = int(keep_inner.sum())
        new_row = keep_inner.long().cumsum(0) - 1
        row_counts = torch.bincount(new_row[rows[keep_edge]], minlength=n_inner)
        indptr = torch.zeros(n_inner + 1, dtype=torch.int64)
        torch.cumsum(row_counts, 0, out=indptr[1:])
        degree = torch.cat([row_counts.float(), torch.zeros(int(keep_boundary.sum()))])
        return Topology(
            n_inner=n_inner,
            indptr=indptr,
            indices=new_column[self.indices[keep_edge]].to(self.indices.dtype),  # ids only shrink
            degree=degree,
            boundary_counts=segment_counts(keep_boundary, self.boundary_counts),
            send_nodes=new_row[self.send_nodes[keep_send]],
            send_counts=segment_counts(keep_send, self.send_counts),
        )


@dataclass
class Shard:
    """A rank's partition: topology plus inner nodes' features, labels and masks.

    ``features`` float32 [n_inner, F]; ``labels`` int64 [n_inner] or float32 [n_inner, C]
    (multi-label); masks bool [n_inner].
    """

    part: int
    num_parts: int
    manifest: dict
    topology: Topology
    features: torch.Tensor
    labels: torch.Tensor
    train_mask: torch.Tensor
    val_mask: torch.Tensor
    test_mask: torch.Tensor

    @property
    def num_classes(self) -> int:
        return int(self.manifest["dataset"]["num_classes"])

    @property
    def multilabel(self) -> bool:
        return bool(self.manifest["dataset"].get("multilabel", False))

    def to(self, device: torch.device) -> Shard:
        """Node data on ``device``; the topology stays on the CPU (kernels copy what they need)."""
        return replace(
            self,
            features=self.features.to(device),
            labels=self.labels.to(device),
            train_mask=self.train_mask.to(device),
            val_mask=self.val_mask.to(device),
            test_mask=self.test_mask.to(device),
        )


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The partition file's array as a ``dtype`` tensor: used in place when the file holds
    that dtype already (a copy-on-write mapping, see :func:`bnsgcn.data.format.load_partition`:
    pages are read from the file as they are touched, and a write would stay private to
    this process), else converted into memory."""
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def load_shard(parts_dir: Path, part: int, num_ranks: int | None, verify: bool = False) -> Shard:
    """Load partition ``part`` for a job of ``num_ranks`` ranks (which must equal the part
    count; None: any count, for a work pool, see :mod:`bnsgcn.sync.workpool`). With ``verify``
    every file's checksum and every index are checked (:func:`bnsgcn.data.format.load_partition`,
    :func:`bnsgcn.data.format.check_partition_values`)."""
    arrays = load_partition(parts_dir, part, verify=verify)
    if num_ranks is not None and arrays.num_parts != num_ranks:
        raise UserError(
            f"{parts_dir} has {arrays.num_parts} partitions but the job has {num_ranks} ranks; "
            f"start {arrays.num_parts} ranks or re-partition with --parts {num_ranks}"
        )
    check_partition_values(arrays, full=verify)
    n_inner = int(arrays["inner_nodes"].shape[0])
    labels = arrays["labels"]
    multilabel = labels.ndim == 2
    topology = Topology(
        n_inner=n_inner,
        indptr=_tensor(arrays["adj_indptr"], torch.int64),
        indices=_tensor(arrays["adj_indices"], torch.int32),  # the format's dtype: used in place
        degree=_tensor(arrays["degree"], torch.float32),
        boundary_counts=np.diff(arrays["boundary_offsets"]).tolist(),
        send_nodes=_tensor(arrays["send_nodes"], torch.int64),
        send_counts=np.diff(arrays["send_offsets"]).tolist(),
    )
    # The loaders check the dataset; these catch a partition set edited or damaged since
    # (sizes unchanged, so only --verify's checksums would notice), naming file and node.
    part_dir = arrays.directory
    problem = csr_problem(topology.indptr, topology.indices, n_inner + topology.n_boundary)
    if problem is not None:
        raise UserError(
            f"{part_dir / 'adj_indptr.npy'} and adj_indices.npy do not form this partition's adjacency ({problem}); "
            "the files were edited or damaged: re-run bnsgcn-partition --force"
        )
    features = _tensor(arrays["features"], torch.float32)
    bad_rows = ~torch.isfinite(features).all(dim=1)
    if bad_rows.any():
        node = int(arrays["inner_nodes"][int(bad_rows.nonzero()[0])])
        raise UserError(
            f"{part_dir / 'features.npy'} holds NaN or infinite values (first at node {node}); "
            "clean the dataset's features and re-partition"
        )
    num_classes = int(arrays.manifest["dataset"]["num_classes"])
    label_tensor = _tensor(labels, torch.float32 if multilabel else torch.int64)
    high, allowed = (1, "0 or 1") if multilabel else (num_classes - 1, f"in [0, {num_classes})")
    bad_rows = (label_tensor < 0) | (label_tensor > high)
    if multilabel:
        bad_rows = bad_rows.any(dim=1)
    if bad_rows.any():
        node = int(arrays["inner_nodes"][int(bad_rows.nonzero()[0])])
        raise UserError(
            f"{part_dir / 'labels.npy'} holds labels that are not {allowed} (first at node {node}); "
            "fix the dataset's labels (or its num_classes) and re-partition"
        )
    return Shard(
        part=part,
        num_parts=arrays.num_parts,
        manifest=arrays.manifest,
        topology=topology,
        features=features,
        labels=label_tensor,
        train_mask=_tensor(arrays["train_mask"], torch.bool),
        val_mask=_tensor(arrays["val_mask"], torch.bool),
        test_mask=_tensor(arrays["test_mask"], torch.bool),
    )
