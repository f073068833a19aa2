"""Boundary exchange strategies: how sampled boundary rows and their gradients move each epoch.

Every strategy implements :class:`~bnsgcn.exchange.base.Exchange`; :func:`make_exchange`
builds the one a configuration asks for:

* :class:`~bnsgcn.exchange.base.LocalExchange` (``--p 0``): no row moves;
* :class:`~bnsgcn.exchange.synchronous.BoundaryExchange`: this epoch's rows, waited for
  in each layer;
* :class:`~bnsgcn.exchange.stale.StaleExchange` (``--staleness 1``): the rows their owners
  sent during the previous epoch;
* :class:`~bnsgcn.exchange.bounded_lag.LagExchange` (``--staleness 1 --max-lag S``): rows
  point to point, up to ``S`` epochs old.

The steps they share (encode, all-to-all, relay, decode) are :mod:`bnsgcn.exchange.transfers`.
"""

from __future__ import annotations

import logging

from bnsgcn.comm.communicator import Comm
from bnsgcn.comm.planners import Planner, resolve_mode
from bnsgcn.comm.wire import WireFormat
from bnsgcn.config import TrainConfig
from bnsgcn.data.shard import Topology
from bnsgcn.exchange.base import Exchange, InFlight, LocalExchange, Sampling
from bnsgcn.exchange.bounded_lag import LagExchange
from bnsgcn.exchange.stale import StaleExchange
from bnsgcn.exchange.synchronous import BoundaryExchange

__all__ = [
    "BoundaryExchange",
    "Exchange",
    "InFlight",
    "LagExchange",
    "LocalExchange",
    "Sampling",
    "StaleExchange",
    "make_exchange",
    "resolve_exchange_settings",
]


def resolve_exchange_settings(config: TrainConfig, comm: Comm) -> TrainConfig:
    """``config`` with ``--exchange`` and ``--nonzero-rows`` resolved for this job.

    ``--exchange auto`` is hierarchical when the job spans several machines and some
    machine runs several ranks (:func:`bnsgcn.comm.planners.resolve_mode`), but direct with
    ``--max-lag`` (its rows go point to point from owner to requester: nothing to relay
    inside a node). ``--nonzero-rows auto`` is on when the job spans several machines:
    between them the bytes saved cost more than packing and unpacking the rows; over one
    machine's loopback or NVLink they do not (docs/benchmarks.md, "rows as their nonzero
    entries")."""
    settings = config.exchange
    mode = "direct" if settings.max_lag is not None and settings.mode == "auto" else resolve_mode(settings.mode, comm)
    nonzero = settings.nonzero_rows
    if nonzero == "auto":
        nonzero = "on" if comm.nodes.count > 1 else "off"
    return config.replace(exchange=mode, nonzero_rows=nonzero)


def make_exchange(
    config: TrainConfig, comm: Comm, topology: Topology, planner: Planner, log: logging.Logger
) -> Exchange:
    """The training exchange of ``config`` (its settings resolved, see
    :func:`resolve_exchange_settings`) over the training graph ``topology``, with plans from
    ``planner``. Every rank calls it together (building a :class:`LagExchange` is collective)."""
    settings = config.exchange
    sampling = Sampling(topology, planner, settings.p, config.run.seed, comm.rank)
    if settings.p <= 0.0:
        if settings.max_lag is not None and comm.rank == 0:
            log.info("--max-lag %d: at --p 0 no boundary row travels, so there is nothing to lag", settings.max_lag)
        return LocalExchange(sampling)
    rows_format, grads_format = WireFormat(config.wire_format), WireFormat(config.grad_wire_format)
    synchronous = BoundaryExchange(comm, rows_format, grads_format, settings.nonzero_rows == "on", sampling)
    if not settings.staleness:
        return synchronous
    if settings.max_lag is None:
        return StaleExchange(comm, topology, synchronous, rows_format, grads_format, settings.stale_smoothing)
    if comm.rank == 0 and config.sync.mode == "allreduce":
        log.info(
            "--max-lag %d with --sync allreduce: ranks meet at every step's all-reduce, so none runs ahead; "
            "pass a decoupled --sync (grouped, partial, gossip) for it to matter",
            settings.max_lag,
        )
    return LagExchange(
        comm,
        topology,
        synchronous,
        settings.p,
        config.run.seed,
        settings.max_lag,
        rows_format,
        grads_format,
        settings.stale_smoothing,
    )
