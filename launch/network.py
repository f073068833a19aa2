"""The master's address and port: check the address resolves, pick a port, tell whether one is taken."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from bnsgcn.errors import UserError

DEFAULT_MASTER_PORT = 29500
# Under SLURM the default port is derived from the job id, so that two jobs sharing a node
# (each with its own rank 0 there) do not both listen on 29500: 20000 + id % 20000 stays
# below Linux's ephemeral range (32768 and up), where outgoing connections take ports.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


def default_master_port(environ: Mapping[str, str]) -> int:
    """The master port when neither ``--master-port`` nor ``MASTER_PORT`` names one:
    ``20000 + SLURM_JOB_ID % 20000`` inside a SLURM job, else :data:`DEFAULT_MASTER_PORT`."""
    job_id = environ.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN
    return DEFAULT_MASTER_PORT


def check_port_number(port: int) -> None:
    """Raise :class:`UserError` unless ``port`` is a usable TCP port number."""
    if not 1 <= port <= 65535:
        raise UserError(
            f"--master-port {port} is not a TCP port; pass a number in [1, 65535], e.g. --master-port "
            f"{DEFAULT_MASTER_PORT}"
        )


def check_master_address(address: str) -> None:
    """Raise :class:`UserError` at once when ``address`` does not resolve.

    Without this check a rank would retry connecting to a name that can never resolve
    until ``--timeout`` runs out (five minutes by default) and then blame its peers.
    """
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise UserError(
            f"master address {address!r} does not resolve ({reason}); pass --master-addr (or export MASTER_ADDR) "
            "with the host name or IP address of the node running rank 0"
        ) from None


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
