"""Writing files: whole or not at all, never through a planted link, and one line naming the
file when the disk is full.

Every file a run writes (checkpoints and their parts, ``best_model.pt``, ``config.json``,
``report.json``, the figures, ``metrics.jsonl``, ``log.txt``) and every file of a partition
set (:mod:`bnsgcn.data.format`) is written here:

* :func:`replaced` replaces a file whole, raising the :class:`OSError` of a failure with the
  file's name (the partition step names the file as it will be in the set);
  :func:`atomic` does the same for a run's files, the error as one line. The new content goes to a temporary file with a
  name of its own in the same directory, created with ``O_EXCL | O_NOFOLLOW`` (a link or
  file planted at any name is never followed, written or reused), is flushed to disk and
  renamed over the file. On any failure the temporary file is removed and the file, if
  there was one, is left as it was.
* :class:`LineFile` appends whole lines (``metrics.jsonl``, ``log.txt``): a line that does
  not fit is cut off again, so the file never ends in a torn line.
* An :class:`OSError` on the way becomes one :class:`~bnsgcn.errors.UserError` naming the
  file (:func:`cannot_write`): the disk full (ENOSPC, or a quota: EDQUOT) is said as such.

Bytes reach the OS through ``os.write`` alone, ``torch.save``'s and matplotlib's too (they
write into a :class:`Sink`): a failed write keeps its errno, where ``torch.save`` into a
path reports a short write as ``RuntimeError ... unexpected pos`` and leaves its file.

Imports no torch: ``bnsgcn-report`` writes figures with it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from bnsgcn.errors import UserError

_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Temporary names carry 48 random bits: a name is taken again only if planted there on purpose.
_TEMP_NAME_TRIES = 16


def cannot_write(path: Path, exc: OSError) -> UserError:
    """The one line for ``exc`` raised while writing ``path``."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"cannot write {path}: the disk is full ({reason}); free space or write to another disk")
    return UserError(f"cannot write {path} ({reason}); make it writable or write elsewhere")


class Sink:
    """A file opened for writing, as ``torch.save``, matplotlib and :func:`atomic` write into
    it: every byte by ``os.write``, their SHA-256 kept with ``checksum``. The first failed
    write is kept in ``error`` (``torch.save`` reports it as an error of its own)."""

    def __init__(self, fd: int, checksum: bool = False):
        self.fd = fd
        self.sha256 = hashlib.sha256() if checksum else None
        self.size = 0  # bytes written
        self.error: OSError | None = None

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        written = 0
        try:
            while written < len(view):
                written += os.write(self.fd, view[written:])
        except OSError as exc:
            self.error = exc
            raise
        if self.sha256 is not None:
            self.sha256.update(view)
        self.size += written
        return written

    def flush(self) -> None:
        """Nothing is buffered here (``torch.save`` calls it)."""


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty file next to ``path`` under a name nobody else uses; the mode as
    ``open`` gives (``tempfile.mkstemp`` would make it 0600)."""
    for _ in range(_TEMP_NAME_TRIES):
        temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(temp, _CREATE_NEW, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"{_TEMP_NAME_TRIES} temporary names next to it are taken")


@contextlib.contextmanager
def replaced(path: Path, checksum: bool = False, durable: bool = True) -> Iterator[Sink]:
    """Replace ``path`` whole with what is written into the sink yielded (see the module);
    ``checksum``: the sink keeps the SHA-256 of what was written; ``durable``: the content
    is flushed to disk before the name points at it. What the body does before it ends
    (e.g. write a checksum file) happens before ``path`` is replaced. A failed write,
    close or rename raises its :class:`OSError` (errno kept) with ``path`` as its file name."""
    path = Path(path)
    try:
        fd, temp = _create_temp(path)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    sink = Sink(fd, checksum)
    try:
        try:
            yield sink
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        failure = exc if isinstance(exc, OSError) else sink.error
        if failure is not None and not isinstance(exc, UserError):
            raise OSError(failure.errno, failure.strerror, str(path)) from None
        raise


@contextlib.contextmanager
def atomic(path: Path, checksum: bool = False) -> Iterator[Sink]:
    """:func:`replaced`, durable, a failure as one line (:func:`cannot_write`)."""
    try:
        with replaced(path, checksum) as sink:
            yield sink
    except OSError as exc:
        raise cannot_write(Path(path), exc) from None


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` whole with ``data`` (:func:`atomic`)."""
    with atomic(path) as sink:
        sink.write(data)


def check_writable(folder: Path) -> None:
    """Create and remove a file in ``folder`` (under a name of its own: never through a link
    planted there); raises the :class:`OSError` of a folder that cannot be written."""
    fd, temp = _create_temp(Path(folder) / "write-test")
    os.close(fd)
    os.unlink(temp)


class LineFile:
    """A file that grows by whole lines (see the module)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise cannot_write(self.path, exc) from None

    def append(self, line: bytes) -> None:
        """Append ``line`` (its newline included), all of it or, failing, none of it."""
        size = os.fstat(self.fd).st_size
        try:
            Sink(self.fd).write(line)
        except OSError as exc:
            with contextlib.suppress(OSError):  # shrinking a file needs no space: this holds on a full disk
                os.ftruncate(self.fd, size)
            raise cannot_write(self.path, exc) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
