"""The master port: pick a free one, tell whether one is taken."""

from __future__ import annotations

import socket

from bnsgcn.errors import UserError

DEFAULT_MASTER_PORT = 29500


def check_port_number(port: int) -> None:
    """Raise :class:`UserError` unless ``port`` is a usable TCP port number."""
    if not 1 <= port <= 65535:
        raise UserError(f"--master-port {port} is not a TCP port; pass a number in [1, 65535], e.g. --master-port {DEFAULT_MASTER_PORT}")


def port_in_use(port: int) -> bool:
    """Whether a process on this machine already holds TCP ``port`` on some address.

    Rank 0 listens on every interface (the torch.distributed TCP store), so this binds the
    wildcard address. ``SO_REUSEADDR`` keeps connections lingering in TIME_WAIT from
    counting as "in use", exactly as the store itself would ignore them.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port that is free right now (chosen by the operating system)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])
