"""The job's key-value store: served by rank 0 on one interface, its keys under a secret
prefix, every call bounded.

torch's ``TCPStore`` is served by a thread of rank 0's process. Three things about it need
care:

* **Where it listens.** Left to torch, the server listens on every interface. Rank 0 here
  binds the listening socket itself, to the address ``MASTER_ADDR`` resolves to (the
  loopback interface for a job on one machine), and hands it to the store
  (:func:`serve`). Ranks' own connections (gloo's pairs, NCCL's bootstrap) are bound to the
  interface that reaches ``MASTER_ADDR`` (:func:`interface_reaching`).
* **Who may read and write.** Anything that reaches the port can read and write keys. A
  job started by ``bnsgcn-train`` on one machine gets a random token
  (``BNSGCN_JOB_TOKEN``, in the ranks' environment only) and keeps every key under it, so
  another process can neither guess the job's keys nor plant a value the job will show
  as its error. A job across machines, or under torchrun or srun, has such a token only
  when one is exported on every machine (docs/training.md, "The job's store").
* **A stopped server.** A call that needs an answer (``get``, ``check``, ``add``,
  ``wait``, ``compare_set``) from a server whose process is stopped (``SIGSTOP``, a hung
  machine) blocks for ever, whatever the store's timeout. :class:`JobStore` runs every call
  on a thread of its own and gives up after a bound, raising :class:`StoreSilent`.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

import psutil

from bnsgcn.errors import PeerLost, UserError

if TYPE_CHECKING:  # imported where used: the launcher reads JOB_TOKEN_VARIABLE without torch
    import torch.distributed as dist

JOB_TOKEN_VARIABLE = "BNSGCN_JOB_TOKEN"
GRACE_S = 2.0  # added to a call's own bound: a wait of T seconds may answer just after T


class StoreSilent(PeerLost):
    """The store did not answer within its bound: rank 0's process (which serves it) stopped."""


class JobStore:
    """A ``dist.Store`` whose every call ends within ``timeout`` seconds (``wait``: within its
    own timeout plus :data:`GRACE_S`), or raises :class:`StoreSilent`. Once one call went
    unanswered the store is taken for gone: later calls raise at once."""

    def __init__(self, store: dist.Store, timeout: float) -> None:
        self.raw, self.timeout = store, timeout
        self._calls: queue.Queue = queue.Queue()
        self._silent = False
        threading.Thread(target=self._serve_calls, name="bnsgcn-store", daemon=True).start()

    def _serve_calls(self) -> None:
        while True:
            call, box, done = self._calls.get()
            try:
                box["value"] = call()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            done.set()

    def _call(self, what: str, call, bound: float | None = None) -> object:
        bound = self.timeout if bound is None else bound
        if self._silent:
            raise StoreSilent(f"the job's store (served by rank 0) stopped answering; {what} not attempted")
        box: dict = {}
        done = threading.Event()
        self._calls.put((call, box, done))
        if not done.wait(bound):
            self._silent = True
            raise StoreSilent(f"the job's store (served by rank 0) did not answer {what} within {bound:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def set(self, key: str, value: str | bytes, bound: float | None = None) -> None:
        self._call(f"set {key}", lambda: self.raw.set(key, value), bound)

    def get(self, key: str, bound: float | None = None) -> bytes:
        return self._call(f"get {key}", lambda: self.raw.get(key), bound)

    def multi_get(self, keys: list[str], bound: float | None = None) -> list[bytes]:
        return self._call(f"multi_get {keys}", lambda: self.raw.multi_get(keys), bound)

    def check(self, keys: list[str], bound: float | None = None) -> bool:
        return self._call(f"check {keys}", lambda: self.raw.check(keys), bound)

    def add(self, key: str, amount: int, bound: float | None = None) -> int:
        return self._call(f"add {key}", lambda: self.raw.add(key, amount), bound)

    def compare_set(self, key: str, expected: str, desired: str, bound: float | None = None) -> bytes:
        return self._call(f"compare_set {key}", lambda: self.raw.compare_set(key, expected, desired), bound)

    def delete_key(self, key: str, bound: float | None = None) -> bool:
        return self._call(f"delete_key {key}", lambda: self.raw.delete_key(key), bound)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Block until every key exists, at most ``timeout`` (then the store's own error)."""
        seconds = timeout.total_seconds()
        self._call(f"wait {keys}", lambda: self.raw.wait(keys, timeout), seconds + GRACE_S)


def job_prefix(environ: dict[str, str] | None = None) -> str:
    """The prefix of every key of this job's attempt: its token (where the launch gave one)
    and torchrun's restart count (a restarted attempt gets the same store, still holding the
    dead attempt's peer addresses)."""
    environ = os.environ if environ is None else environ
    token = environ.get(JOB_TOKEN_VARIABLE, "")
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"bnsgcn/{token + '/' if token else ''}attempt-{attempt}/"


def serve(address: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """Rank 0: the job's store, listening on ``address`` (resolved) alone, not every interface.
    A port already taken is refused in one line."""
    import torch.distributed as dist

    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(sockaddr)
    except OSError as exc:
        listener.close()
        if exc.errno == 98:  # EADDRINUSE
            raise UserError(
                f"master port {port} is already in use on {sockaddr[0]}; pass a free --master-port (or export "
                "MASTER_PORT), or leave it to bnsgcn-train on one machine"
            ) from None
        raise UserError(
            f"rank 0 cannot listen on {address} ({sockaddr[0]}:{port}: {exc.strerror}); MASTER_ADDR must name the "
            "machine that runs rank 0"
        ) from None
    listener.listen(max(128, world_size))
    store = dist.TCPStore(
        address,
        port,
        world_size,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )
    return store


def interface_reaching(address: str) -> str | None:
    """The name of this machine's network interface that ``address`` is reached through
    (``lo`` for a loopback address), or None when that cannot be told."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # no packet is sent: the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None
