"""The interface every boundary exchange strategy implements, and the epoch's sample.

A training run holds one :class:`Exchange`, built by :func:`bnsgcn.exchange.make_exchange`
from the configuration. Each epoch the train loop asks it for the epoch's boundary sample
and plan (:meth:`Exchange.draw`), builds the epoch's graph over it, and the model's layers
start their boundary rows through it (:meth:`Exchange.start`,
:meth:`Exchange.start_aggregating`); backward sends the rows' gradients back the same way.
Checkpoints save what a strategy holds between epochs (:meth:`Exchange.state_dict`), and
the run closes it at the end (:meth:`Exchange.close`). The loop never asks which strategy
it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from torch import Tensor

from bnsgcn.comm.plan import ExchangePlan
from bnsgcn.comm.planners import Planner
from bnsgcn.data.sampler import sample_boundary
from bnsgcn.data.shard import Topology
from bnsgcn.kernels import Adjacency, spmm, spmm_add_
from bnsgcn.metrics.memory import storage_bytes


class InFlight(Protocol):
    """One layer's boundary rows on their way: :meth:`wait` returns them
    [plan.num_received, *row], autograd-connected (backward sends their gradients)."""

    def wait(self) -> Tensor: ...


class Sampling:
    """The epoch's boundary sample (:func:`bnsgcn.data.sampler.sample_boundary`, seeded by
    (seed, rank, epoch)) and its plan (the planner's: direct or node-aware)."""

    def __init__(self, topology: Topology, planner: Planner, p: float, seed: int, rank: int) -> None:
        self.topology, self.planner, self.p, self.seed, self.rank = topology, planner, p, seed, rank

    def draw(self, epoch: int) -> tuple[Tensor, ExchangePlan]:
        """bool [n_boundary] (on the CPU) and the plan; all ranks call together (the plan
        exchanges selections)."""
        keep = sample_boundary(self.topology.boundary_counts, self.p, self.seed, self.rank, epoch)
        return keep, self.planner.sample(keep, self.p)


class Exchange(ABC):
    """How training's boundary rows and their gradients move (see the module).

    ``checkpoint_part``: what a checkpoint keeps of this strategy on every rank (a name
    written into the part, checked when resuming), or None when it holds nothing between
    epochs. ``column_slice_bytes``: 0 when a layer's rows move whole; else the exchange
    moves them in column slices whose buffers take at most this many bytes
    (:class:`~bnsgcn.exchange.sliced.ColumnSlicedExchange`, evaluation's).
    """

    checkpoint_part: str | None = None
    column_slice_bytes: int = 0

    @abstractmethod
    def draw(self, epoch: int) -> tuple[Tensor, ExchangePlan]:
        """Epoch ``epoch``'s boundary columns (bool [n_boundary], on the CPU) and plan. Every
        rank calls it at the start of each epoch (together, unless the strategy says not)."""

    @abstractmethod
    def start(
        self,
        x_inner: Tensor,
        plan: ExchangePlan,
        slot: int,
        category: str = "features",
        zeros_need_no_gradient: bool = False,
    ) -> InFlight:
        """Start fetching the rows of the sampled boundary nodes for layer ``slot`` from
        ``x_inner`` [n_inner, *row] of their owners. ``category`` names the traffic in the
        byte counts; ``zeros_need_no_gradient``: the caller's promise that the gradient of
        an exactly zero entry is discarded (a ReLU's output), which a strategy may use to
        send fewer bytes."""

    def start_aggregating(
        self,
        x_inner: Tensor,
        plan: ExchangePlan,
        slot: int,
        inner: Adjacency,
        into: Tensor | None = None,
        category: str = "features",
        zeros_need_no_gradient: bool = False,
    ) -> tuple[InFlight, Tensor]:
        """:meth:`start`, and while the rows travel the inner columns' product
        ``A_inner x_inner`` [n_inner, *row] (with ``into``, summed into it in place).
        Returns both."""
        rows = self.start(x_inner, plan, slot, category, zeros_need_no_gradient)
        return rows, spmm(inner, x_inner) if into is None else spmm_add_(into, inner, x_inner)

    def figures(self) -> dict[str, float]:
        """The strategy's own per-epoch figures for the records (columns of
        :data:`bnsgcn.metrics.accounting.COLUMNS`)."""
        return {}

    def buffers(self) -> list[Tensor | None]:
        """Every buffer it holds now (for the accounting of resident memory)."""
        return []

    def largest_bytes(self) -> int:
        """Bytes of its buffers at their largest (what the memory report shows)."""
        return storage_bytes(self.buffers())

    def release(self) -> None:
        """Free what the next epoch can allocate again (before an evaluation)."""

    def drain(self) -> None:
        """Wait until nothing is in flight (before a checkpoint)."""

    def state_dict(self) -> dict:
        """What the next epoch needs of this rank's strategy (call :meth:`drain` first)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s output."""

    def close(self) -> None:
        """At the end of training: nothing may be in flight when the job's groups close."""


def no_rows(x_inner: Tensor) -> InFlight:
    """An exchange that moved nothing: no boundary row of ``x_inner`` [n, *row]."""
    return _NoRows(x_inner.new_zeros((0, *x_inner.shape[1:])))


class _NoRows:
    def __init__(self, empty: Tensor) -> None:
        self.empty = empty

    def wait(self) -> Tensor:
        return self.empty


class LocalExchange(Exchange):
    """At p = 0 (and for the work pool's partitions): no boundary row is sampled, so none
    travels and no collective runs per layer (an all-to-all of empty rows would still be a
    barrier). ``sampling`` draws the (empty) sample and plan; None where nothing draws."""

    def __init__(self, sampling: Sampling | None = None) -> None:
        self.sampling = sampling

    def draw(self, epoch: int) -> tuple[Tensor, ExchangePlan]:
        return self.sampling.draw(epoch)

    def start(self, x_inner, plan, slot, category="features", zeros_need_no_gradient=False) -> InFlight:
        return no_rows(x_inner)
