"""Fetching a named dataset from its public source: ``bnsgcn-partition DATASET --download``.

:data:`DOWNLOADS` is the table: for each dataset its source, the files fetched (with size
and SHA-256 where known), their kind (the dataset's files themselves, or one zip archive),
the folder under the data directory they go to (the first one the dataset's loader
searches) and the files the loader needs there. :func:`resolve_or_download` resolves the
dataset as :func:`~bnsgcn.partition.datasets.resolve_dataset` does and downloads it only
when that fails, so a second run fetches nothing.

A download is staged in ``<data_dir>/<folder>.download/``. Each file arrives as
``<name>.part``; a transfer that stops leaves it there, and the next run continues it with
an HTTP Range request (or starts over when the server ignores the range). A complete file
is checked against the body's Content-Length, the table's size and SHA-256, and renamed
to ``<name>``. Then the files are moved, or the archive is extracted, into a temporary
folder next to the target, which is renamed into place whole, and the staging folder is
removed. Every failure is one :class:`~bnsgcn.errors.UserError` line naming the dataset,
the URL and the fix, and leaves no dataset folder behind: at most the staging folder with
what a later run can continue from.

Each source's base URL can be replaced: :data:`MIRROR_VARIABLE` for all of them (files are
then fetched from ``<mirror>/<source>/<name>``), or one variable per source
(:attr:`Source.variable`), which wins over the mirror. Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import os
import re
import secrets
import shutil
import sys
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from bnsgcn.errors import UserError
from bnsgcn.files import Sink, cannot_write
from bnsgcn.metrics import progress as display

from ..coarse import format_bytes
from . import DEFAULT_DATA_DIR, PLANETOID_NAMES, DatasetSource, Progress, reddit, resolve_dataset, saint
from .planetoid import PICKLED_PARTS

MIRROR_VARIABLE = "BNSGCN_DOWNLOAD_MIRROR"
TIMEOUT_S = 60.0  # on connecting and on every read: a stalled transfer fails instead of hanging
CHUNK_BYTES = 1 << 20
LOCK_NAME = ".lock"
FILES, ZIP = "files", "zip"  # the kinds of download


@dataclass(frozen=True)
class Source:
    """Where a group of datasets is served from: ``url``/<file name>."""

    name: str  # the folder under a mirror
    url: str
    variable: str  # the environment variable that replaces ``url``

    def base_url(self) -> str:
        """``url``, or its replacement by :attr:`variable` or :data:`MIRROR_VARIABLE`."""
        own = os.environ.get(self.variable)
        if own:
            return own.rstrip("/")
        mirror = os.environ.get(MIRROR_VARIABLE)
        return f"{mirror.rstrip('/')}/{self.name}" if mirror else self.url


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None = None  # bytes
    sha256: str | None = None


@dataclass(frozen=True)
class Download:
    """One dataset's download (see the module)."""

    dataset: str
    source: Source
    kind: str  # FILES: ``files`` are the dataset's files; ZIP: ``files`` is one zip archive
    files: tuple[RemoteFile, ...]
    folder: str  # under the data directory
    expected: tuple[str, ...]  # what the loader needs in ``folder``, checked before it is put in place


PLANETOID = Source("planetoid", "https://github.com/kimiyoung/planetoid/raw/master/data", "BNSGCN_PLANETOID_URL")
DGL = Source("dgl", "https://data.dgl.ai/dataset", "BNSGCN_DGL_URL")
OGB = Source("ogb", "http://snap.stanford.edu/ogb/data/nodeproppred", "BNSGCN_OGB_URL")  # as ogb's master.csv
SOURCES = (PLANETOID, DGL, OGB)

# Size and SHA-256 of the files in kimiyoung/planetoid's data folder (ind.pubmed.allx: not known).
PLANETOID_CHECKSUMS: dict[str, tuple[int | None, str | None]] = {
    "ind.cora.x": (22119, "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab"),
    "ind.cora.y": (4054, "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1"),
    "ind.cora.tx": (148025, "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a"),
    "ind.cora.ty": (28135, "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad"),
    "ind.cora.allx": (257305, "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543"),
    "ind.cora.ally": (47959, "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71"),
    "ind.cora.graph": (59847, "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d"),
    "ind.cora.test.index": (5000, "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875"),
    "ind.citeseer.x": (31087, "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6"),
    "ind.citeseer.y": (3014, "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924"),
    "ind.citeseer.tx": (260321, "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21"),
    "ind.citeseer.ty": (24135, "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce"),
    "ind.citeseer.allx": (595021, "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668"),
    "ind.citeseer.ally": (55623, "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95"),
    "ind.citeseer.graph": (61987, "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7"),
    "ind.citeseer.test.index": (5000, "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4"),
    "ind.pubmed.x": (23172, "fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33"),
    "ind.pubmed.y": (854, "e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3"),
    "ind.pubmed.tx": (405505, "4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d"),
    "ind.pubmed.ty": (12135, "ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd"),
    "ind.pubmed.allx": (None, None),
    "ind.pubmed.ally": (224739, "0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e"),
    "ind.pubmed.graph": (471808, "5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9"),
    "ind.pubmed.test.index": (6000, "b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5"),
}
OGB_CSV_FILES = (
    "raw/edge.csv.gz",
    "raw/num-node-list.csv.gz",
    "raw/num-edge-list.csv.gz",
    "raw/node-feat.csv.gz",
    "raw/node-label.csv.gz",
)


def _planetoid(name: str) -> Download:
    names = tuple(f"ind.{name}.{part}" for part in (*PICKLED_PARTS, "test.index"))
    files = tuple(RemoteFile(file, *PLANETOID_CHECKSUMS[file]) for file in names)
    return Download(name, PLANETOID, FILES, files, name, names)


def _ogb(name: str, archive: str, data_files: tuple[str, ...], split: str) -> Download:
    splits = tuple(f"split/{split}/{part}.csv.gz" for part in ("train", "valid", "test"))
    expected = ("RELEASE_v1.txt", *data_files, *splits)
    return Download(name, OGB, ZIP, (RemoteFile(archive),), name.replace("-", "_"), expected)


def _dgl(name: str, expected: tuple[str, ...]) -> Download:
    return Download(name, DGL, ZIP, (RemoteFile(f"{name}.zip"),), name, expected)


_YELP = _dgl("yelp", saint.FILES)
# The dataset specs that --download serves, in the order messages list them.
DOWNLOADS: dict[str, Download] = {
    **{name: _planetoid(name) for name in PLANETOID_NAMES},
    "reddit": _dgl("reddit", reddit.FILES),
    "ogbn-arxiv": _ogb("ogbn-arxiv", "arxiv.zip", (*OGB_CSV_FILES, "raw/node_year.csv.gz"), "time"),
    "ogbn-products": _ogb("ogbn-products", "products.zip", OGB_CSV_FILES, "sales_ranking"),
    "ogbn-papers100M": _ogb("ogbn-papers100M", "papers100M-bin.zip", ("raw/data.npz", "raw/node-label.npz"), "time"),
    "yelp": _YELP,
    "saint:yelp": _YELP,
    "saint:flickr": _dgl("flickr", saint.FILES),
}


def find_download(spec: str) -> Download | None:
    """The download of the dataset ``spec`` names (names are case-insensitive), or None."""
    return {key.lower(): download for key, download in DOWNLOADS.items()}.get(spec.lower())


def resolve_or_download(spec: str, data_dir: Path | None, progress: bool = True) -> DatasetSource:
    """:func:`resolve_dataset`, after downloading the dataset's files when resolving fails
    and the dataset has a download; otherwise the resolver's error, saying what
    ``--download`` covers."""
    try:
        return resolve_dataset(spec, data_dir)
    except UserError as missing:
        download = find_download(spec)
        if download is None:
            raise UserError(f"{missing}; --download fetches only {', '.join(DOWNLOADS)}") from None
        fetch(download, Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR, str(missing), progress)
    return resolve_dataset(spec, data_dir)


def fetch(download: Download, data_dir: Path, missing: str, progress: bool = True) -> None:
    """Download ``download`` into ``data_dir/<folder>`` (see the module); ``missing`` is why
    the dataset could not be resolved, said again when an existing folder is in the way."""
    target = data_dir / download.folder
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        target.rmdir()
    if os.path.lexists(target):
        raise UserError(
            f"{missing}; --download does not replace the existing {target}: move it away (or fix it) and run again"
        )
    staging = data_dir / f"{download.folder}.download"
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_write(staging, exc) from None
    with _locked(staging, download):
        try:
            fetched = [_fetch_file(download, remote, staging, progress) for remote in download.files]
            _install(download, fetched, target, Progress(download.dataset, progress))
        finally:
            if all(path.name == LOCK_NAME for path in staging.iterdir()):  # nothing a later run could continue from
                shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _locked(staging: Path, download: Download) -> Iterator[None]:
    """Hold the staging folder's lock: two runs appending to one ``.part`` would spoil it."""
    fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"{download.dataset}: another process is downloading into {staging}; wait for it to finish, then "
                "run again"
            ) from None
        yield
    finally:
        os.close(fd)


def _fix(download: Download) -> str:
    """How to point the download elsewhere."""
    return f"set {download.source.variable} (or {MIRROR_VARIABLE}) to a mirror that serves the files"


def _fetch_file(download: Download, remote: RemoteFile, staging: Path, progress: bool) -> Path:
    """``staging/<name>``, downloaded (or continued from ``<name>.part``) and checked."""
    done = staging / remote.name
    if done.is_file():  # fetched and checked by an earlier run that stopped later on
        return done
    url = f"{download.source.base_url()}/{remote.name}"
    part = staging / f"{remote.name}.part"
    offset = part.stat().st_size if part.is_file() else 0
    response, start, total = _open(download, url, offset, part)
    with response:
        if remote.size is not None and total is not None and total != remote.size:
            _corrupt(download, url, part, f"is {total:,} bytes, expected {remote.size:,}")
        if progress:
            resumed = f", continuing after {format_bytes(start)}" if start else ""
            known = format_bytes(total) if total is not None else "size not given"
            print(f"{download.dataset}: downloading {url} ({known}{resumed})", file=sys.stderr, flush=True)
        digest = _hash_prefix(part, start)
        size = _receive(download, url, response, part, start, total, digest, progress)
    if total is not None and size < total:
        raise _stopped(download, url, part, size, total, None)
    if remote.size is not None and size != remote.size:
        _corrupt(download, url, part, f"is {size:,} bytes, expected {remote.size:,}")
    if remote.sha256 is not None and digest.hexdigest() != remote.sha256:
        _corrupt(download, url, part, f"has SHA-256 {digest.hexdigest()}, expected {remote.sha256}")
    os.replace(part, done)
    return done


def _open(download: Download, url: str, offset: int, part: Path) -> tuple[http.client.HTTPResponse, int, int | None]:
    """The response to a GET of ``url`` continuing at ``offset``, the offset its body starts
    at (0 when the server sends the whole file) and the file's size when known."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and offset:  # the kept part is not shorter than the file: it is not a prefix of it
            return _open(download, url, 0, part)
        raise UserError(
            f"{download.dataset}: {url} answered HTTP {exc.code} {exc.reason}; check the URL, or {_fix(download)}"
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise _network_error(download, url, exc, part) from None
    start = 0
    if response.status == 206:
        content_range = re.fullmatch(r"bytes (\d+)-\d+/\d+", response.headers.get("Content-Range", ""))
        if content_range is None or int(content_range[1]) != offset:
            response.close()
            return _open(download, url, 0, part)
        start = offset
    length = response.headers.get("Content-Length", "")
    return response, start, start + int(length) if length.isdigit() else None


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, TimeoutError):
        return f"no answer for {TIMEOUT_S:g} s"
    return str(reason) or type(reason).__name__


def _network_error(download: Download, url: str, exc: BaseException, part: Path) -> UserError:
    kept = f"; {part} is kept and continued then" if part.is_file() and part.stat().st_size else ""
    return UserError(
        f"{download.dataset}: cannot download {url} ({_reason(exc)}); check the network connection, or "
        f"{_fix(download)}, and run again with --download{kept}"
    )


def _stopped(
    download: Download, url: str, part: Path, size: int, total: int | None, exc: BaseException | None
) -> UserError:
    """A transfer that ended early: ``part`` holds its first ``size`` bytes."""
    of = f" of {total:,}" if total is not None else ""
    because = f" ({_reason(exc)})" if exc is not None else ""
    return UserError(
        f"{download.dataset}: the download of {url} stopped after {size:,}{of} bytes{because}; run again with "
        f"--download to continue it ({part} is kept for that)"
    )


def _hash_prefix(part: Path, start: int) -> hashlib._Hash:
    """SHA-256 over the first ``start`` bytes of ``part``: the bytes a resumed download keeps."""
    digest = hashlib.sha256()
    if start:
        with open(part, "rb") as handle:
            while chunk := handle.read(min(CHUNK_BYTES, start - handle.tell())):
                digest.update(chunk)
    return digest


def _receive(
    download: Download,
    url: str,
    response: http.client.HTTPResponse,
    part: Path,
    start: int,
    total: int | None,
    digest: hashlib._Hash,
    progress: bool,
) -> int:
    """Write the body of ``response`` into ``part`` from byte ``start`` on; the size reached."""
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        os.ftruncate(fd, start)
        os.lseek(fd, start, os.SEEK_SET)
        sink = Sink(fd)
        with display.Progress(
            total,
            f"{download.dataset}: {part.name.removesuffix('.part')}",
            enabled=progress,
            interval=display.LOG_HEARTBEAT_S,
            initial=start,
            unit=format_bytes,
        ) as bar:
            while True:
                try:
                    chunk = response.read(CHUNK_BYTES)
                except (http.client.HTTPException, OSError) as exc:  # a closed connection, a reset, a timeout
                    raise _stopped(download, url, part, start + sink.size, total, exc) from None
                if not chunk:
                    return start + sink.size
                try:
                    sink.write(chunk)
                except OSError as exc:
                    raise UserError(f"{cannot_write(part, exc)}; the part written is kept and continued then") from None
                digest.update(chunk)
                bar.update(len(chunk))
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _corrupt(download: Download, url: str, path: Path, problem: str) -> None:
    """Delete the bad download ``path`` and raise the line saying so."""
    _discard(path)
    raise UserError(
        f"{download.dataset}: the download of {url} {problem}: it is damaged or not the dataset's file and was "
        f"deleted; run again with --download to fetch it anew, or {_fix(download)}"
    )


def _install(download: Download, fetched: list[Path], target: Path, steps: Progress) -> None:
    """Put the fetched files (or the archive's content) into ``target`` at once: built in a
    temporary folder next to it, checked, then renamed."""
    temp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(6)}")
    try:
        temp.mkdir()  # the mode a folder gets (tempfile's would be private)
    except OSError as exc:
        raise cannot_write(temp, exc) from None
    try:
        if download.kind == ZIP:
            (archive,) = fetched
            url = f"{download.source.base_url()}/{archive.name}"
            with steps.step(f"extracting {archive.name} into {target}"):
                _extract(download, url, archive, temp)
            missing = [name for name in download.expected if not (temp / name).is_file()]
            if missing:
                _corrupt(download, url, archive, f"lacks {', '.join(missing)}")
            archive.unlink()
        else:
            for file in fetched:
                os.replace(file, temp / file.name)
        os.rename(temp, target)
    except OSError as exc:
        raise cannot_write(target, exc) from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _extract(download: Download, url: str, archive: Path, temp: Path) -> None:
    """Extract ``archive`` into ``temp``; an archive holding one folder at its top gives that
    folder's content (OGB's ``arxiv/`` ...). Members may not leave the folder."""
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = [member for member in zipped.infolist() if not member.is_dir()]
            tops = {member.filename.split("/", 1)[0] for member in members}
            nested = len(tops) == 1 and all("/" in member.filename for member in members)
            prefix = f"{tops.pop()}/" if nested else ""
            for member in members:
                relative = PurePosixPath(member.filename.removeprefix(prefix))
                is_link = (member.external_attr >> 16) & 0o170000 == 0o120000
                if relative.is_absolute() or ".." in relative.parts or is_link:
                    raise zipfile.BadZipFile(f"member {member.filename} would be written outside the folder")
                path = temp.joinpath(*relative.parts)
                path.parent.mkdir(parents=True, exist_ok=True)
                with zipped.open(member) as source, open(path, "wb") as sink:
                    shutil.copyfileobj(source, sink, CHUNK_BYTES)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        _corrupt(download, url, archive, f"is not a readable zip archive ({exc})")
