"""``bnsgcn-partition DATASET --download`` against a local HTTP server.

The server (``http.server`` on 127.0.0.1, a port of its own) serves tiny files built here in
each source's layout, under the mirror variable's ``<mirror>/<source>/<name>`` paths; it
records every request with its Range header, answers Range requests (206) unless told to
ignore them, and can cut a body short or stall in the middle of one.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import os
import pickle
import re
import threading
import zipfile
from collections import defaultdict
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import bnsgcn
from bnsgcn.errors import UserError
from bnsgcn.metrics.progress import Progress
from bnsgcn.partition.cli import main
from bnsgcn.partition.coarse import format_bytes
from bnsgcn.partition.datasets import download, load_dataset, resolve_dataset
from bnsgcn.partition.datasets.ogb import _layouts, _metadata
from bnsgcn.partition.graph import Graph

SHARED_PLANETOID = Path(__file__).resolve().parents[2] / "shared" / "data" / "planetoid"


# ----------------------------------------------------------------------------- the server


@dataclass
class Served:
    url: str = ""
    files: dict[str, bytes] = field(default_factory=dict)  # URL path -> body
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range header)
    cut: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before closing, once
    stall: set[str] = field(default_factory=set)  # paths whose body stops half-way without closing
    ignore_range: bool = False


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        served: Served = self.server.served
        served.requests.append((self.path, self.headers.get("Range")))
        body = served.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if wanted and not served.ignore_range:
            start = int(wanted[1])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        sent = body[start:]
        if self.path in served.cut:
            sent = sent[: served.cut.pop(self.path)]
            self.close_connection = True
        elif self.path in served.stall:
            self.wfile.write(sent[: len(sent) // 2])
            self.wfile.flush()
            self.server.released.wait(5)
            return
        self.wfile.write(sent)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.released = threading.Event()  # ends a stalled body at teardown
    httpd.served = served = Served(url=f"http://127.0.0.1:{httpd.server_port}")
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv(download.MIRROR_VARIABLE, served.url)
    for source in download.SOURCES:
        monkeypatch.delenv(source.variable, raising=False)
    monkeypatch.setenv("no_proxy", "*")  # a proxy configured around the tests must not see 127.0.0.1
    yield served
    httpd.released.set()
    httpd.shutdown()
    httpd.server_close()


def serve(served: Served, monkeypatch: pytest.MonkeyPatch, spec: str, bodies: dict[str, bytes]) -> None:
    """Serve ``bodies`` (file name -> bytes) as ``spec``'s files, the table giving their size and SHA-256."""
    entry = download.find_download(spec)
    for name, body in bodies.items():
        served.files[f"/{entry.source.name}/{name}"] = body
    files = tuple(
        download.RemoteFile(name, len(body), hashlib.sha256(body).hexdigest()) for name, body in bodies.items()
    )
    monkeypatch.setitem(download.DOWNLOADS, spec, replace(entry, files=files))


def run(*argv: str | Path) -> int:
    return main([str(arg) for arg in argv])


def error_line(capsys: pytest.CaptureFixture, *fragments: str) -> str:
    """The run's one error line (nothing else on stderr but progress), holding every fragment."""
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    for fragment in fragments:
        assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    return errors[0]


def assert_same_graph(graph: Graph, expected: Graph) -> None:
    for name in ("indptr", "indices", "features", "labels", "train_mask", "val_mask", "test_mask"):
        np.testing.assert_array_equal(getattr(graph, name), getattr(expected, name), err_msg=name)
    assert graph.num_classes == expected.num_classes


# ----------------------------------------------------------------------------- tiny datasets


def planetoid_files(name: str = "cora") -> dict[str, bytes]:
    """A tiny Planetoid set (Python pickles of dense arrays): 5 training, 500 validation, 4 test nodes."""
    rng = np.random.default_rng(5)
    known, classes = 506, 3
    allx = (rng.random((known, 4)) < 0.5).astype(np.float32)
    ally = np.eye(classes)[rng.integers(0, classes, known)]
    graph = defaultdict(list)
    for u, v in rng.integers(0, known + 4, (40, 2)).tolist():
        graph[u].append(v)
    parts = {
        "x": allx[:5],
        "y": ally[:5],
        "tx": rng.random((4, 4)).astype(np.float32),
        "ty": np.eye(classes)[[2, 0, 1, 1]],
        "allx": allx,
        "ally": ally,
        "graph": graph,
    }
    files = {f"ind.{name}.{part}": pickle.dumps(value, protocol=2) for part, value in parts.items()}
    return files | {f"ind.{name}.test.index": b"".join(b"%d\n" % i for i in (507, 506, 509, 508))}


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, body in members.items():
            archive.writestr(name, body)
    return buffer.getvalue()


def reddit_members() -> dict[str, bytes]:
    """reddit.zip's two files, at the archive's top as DGL ships them."""
    row, col = np.array([[0, 1], [1, 2], [3, 4], [4, 5], [5, 0]]).T
    return {
        "reddit_data.npz": npz_bytes(
            feature=np.arange(24, dtype=np.float32).reshape(6, 4),
            label=np.array([0, 2, 1, 2, 0, 1]),
            node_types=np.array([1, 1, 2, 3, 1, 3]),
        ),
        "reddit_graph.npz": npz_bytes(format=np.array(b"coo"), shape=np.array([6, 6]), row=row, col=col),
    }


def csv_gz(rows: np.ndarray, fmt: str = "%d") -> bytes:
    text = io.StringIO()
    np.savetxt(text, np.asarray(rows).reshape(len(rows), -1), fmt=fmt, delimiter=",")
    return gzip.compress(text.getvalue().encode())


ARXIV_EDGES = np.array([[0, 1], [1, 2], [2, 0], [3, 4], [5, 4]])
ARXIV_FEATURES = np.round(np.random.default_rng(3).standard_normal((6, 3)), 4)
ARXIV_LABELS = np.array([0, 39, 5, 5, 12, 7])


def arxiv_members() -> dict[str, bytes]:
    """arxiv.zip: OGB's raw CSV layout inside an ``arxiv/`` folder."""
    files = {
        "RELEASE_v1.txt": b"",
        "raw/edge.csv.gz": csv_gz(ARXIV_EDGES),
        "raw/node-feat.csv.gz": csv_gz(ARXIV_FEATURES, "%.4f"),
        "raw/node-label.csv.gz": csv_gz(ARXIV_LABELS),
        "raw/node_year.csv.gz": csv_gz(np.arange(2000, 2006)),
        "raw/num-node-list.csv.gz": csv_gz(np.array([6])),
        "raw/num-edge-list.csv.gz": csv_gz(np.array([len(ARXIV_EDGES)])),
        "split/time/train.csv.gz": csv_gz(np.array([0, 1, 2])),
        "split/time/valid.csv.gz": csv_gz(np.array([3])),
        "split/time/test.csv.gz": csv_gz(np.array([4, 5])),
    }
    return {f"arxiv/{name}": body for name, body in files.items()}


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    for name, body in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(body)
    return folder


# ----------------------------------------------------------------------------- tests


def test_planetoid_download_makes_the_set_and_a_second_run_fetches_nothing(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    files = planetoid_files()
    serve(server, monkeypatch, "cora", files)
    data, out = tmp_path / "data", tmp_path / "parts"
    argv = ("cora", "--download", "--data-dir", data, "--out", out, "--method", "random", "--node-order", "ids")

    assert run(*argv) == 0
    assert "cora: downloading " + server.url + "/planetoid/ind.cora.x" in capsys.readouterr().err
    assert sorted(path.name for path in data.iterdir()) == ["cora"]  # the staging folder is gone
    assert {path.name: path.read_bytes() for path in (data / "cora").iterdir()} == files
    assert sorted(server.requests) == sorted((f"/planetoid/{name}", None) for name in files)
    served_graph = load_dataset("cora", write_files(tmp_path / "served", files), progress=False)
    assert_same_graph(load_dataset("cora", data, progress=False), served_graph)
    assert bnsgcn.PartitionSet.read(out).num_nodes == served_graph.num_nodes == 510

    server.requests.clear()
    assert run(*argv) == 0
    assert server.requests == []
    assert "reusing the partition set" in capsys.readouterr().out


def test_without_download_nothing_is_requested(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    serve(server, monkeypatch, "cora", planetoid_files())
    assert run("cora", "--data-dir", tmp_path / "data", "--out", tmp_path / "parts") == 2
    error_line(capsys, "ind.cora.x", "pass --download to fetch them", "kimiyoung/planetoid")
    assert server.requests == []
    assert not (tmp_path / "data").exists()


def test_ogb_zip_through_the_api(server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    serve(server, monkeypatch, "ogbn-arxiv", {"arxiv.zip": zip_bytes(arxiv_members())})
    parts = bnsgcn.partition(
        "ogbn-arxiv",
        2,
        tmp_path / "parts",
        data_dir=tmp_path,
        download=True,
        method="random",
        num_classes=40,
        progress=False,
    )
    assert parts.num_nodes == 6 and parts.num_classes == 40
    assert (tmp_path / "ogbn_arxiv" / "raw" / "edge.csv.gz").is_file()  # the ogb package's own layout
    assert not (tmp_path / "ogbn_arxiv.download").exists()
    graph = load_dataset("ogbn-arxiv", tmp_path, progress=False)
    np.testing.assert_allclose(graph.features, ARXIV_FEATURES, rtol=1e-6)
    np.testing.assert_array_equal(graph.labels, ARXIV_LABELS)
    edges = {(int(u), int(v)) for v in range(6) for u in graph.indices[graph.indptr[v] : graph.indptr[v + 1]]}
    assert edges == {(u, v) for a, b in ARXIV_EDGES.tolist() for u, v in ((a, b), (b, a))}
    np.testing.assert_array_equal(np.flatnonzero(graph.train_mask), [0, 1, 2])


@pytest.mark.parametrize("ignore_range", [False, True])
def test_a_cut_transfer_is_one_line_and_continues_from_its_part(
    server: Served,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    ignore_range: bool,
) -> None:
    members = reddit_members()
    archive = zip_bytes(members)
    serve(server, monkeypatch, "reddit", {"reddit.zip": archive})
    server.cut["/dgl/reddit.zip"] = len(archive) // 3
    argv = ("reddit", "--download", "--data-dir", tmp_path, "--out", tmp_path / "parts", "--method", "random")

    assert run(*argv) == 2
    error_line(capsys, "reddit", f"{server.url}/dgl/reddit.zip", "--download", "reddit.zip.part", "kept")
    part = tmp_path / "reddit.download" / "reddit.zip.part"
    assert part.read_bytes() == archive[: len(archive) // 3]
    assert not (tmp_path / "reddit").exists()
    with pytest.raises(UserError):
        resolve_dataset("reddit", tmp_path)

    server.ignore_range = ignore_range
    assert run(*argv) == 0
    assert server.requests[-1] == ("/dgl/reddit.zip", f"bytes={len(archive) // 3}-")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["parts", "reddit"]
    served_graph = load_dataset("reddit", write_files(tmp_path / "served", members), progress=False)
    assert_same_graph(load_dataset("reddit", tmp_path, progress=False), served_graph)


BAD_ARCHIVES = {
    "not a zip": (b"PK\x03\x04 this is not a zip archive", "is not a readable zip archive"),
    "truncated zip": (zip_bytes(reddit_members())[:-40], "is not a readable zip archive"),
    "a file missing": (zip_bytes({"reddit_data.npz": reddit_members()["reddit_data.npz"]}), "lacks reddit_graph.npz"),
    "a member outside": (zip_bytes({"../reddit_data.npz": b"x", **reddit_members()}), "outside the folder"),
}


@pytest.mark.parametrize("case", BAD_ARCHIVES)
def test_a_corrupt_archive_is_one_line_and_leaves_nothing(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture, case: str
) -> None:
    body, problem = BAD_ARCHIVES[case]
    serve(server, monkeypatch, "reddit", {"reddit.zip": body})
    data = tmp_path / "data"
    assert run("reddit", "--download", "--data-dir", data, "--out", tmp_path / "parts") == 2
    error_line(capsys, "reddit", f"{server.url}/dgl/reddit.zip", problem, "deleted", "--download")
    assert list(data.iterdir()) == []
    assert not (tmp_path / "parts").exists()


def test_a_wrong_checksum_is_one_line_and_leaves_nothing(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    files = planetoid_files()
    serve(server, monkeypatch, "cora", files)
    entry = download.DOWNLOADS["cora"]
    wrong = (replace(entry.files[0], sha256="0" * 64), *entry.files[1:])
    monkeypatch.setitem(download.DOWNLOADS, "cora", replace(entry, files=wrong))
    assert run("cora", "--download", "--data-dir", tmp_path / "data", "--out", tmp_path / "parts") == 2
    error_line(capsys, "cora", f"{server.url}/planetoid/ind.cora.x", "SHA-256", "0" * 64, "BNSGCN_PLANETOID_URL")
    assert list((tmp_path / "data").iterdir()) == []


@pytest.mark.parametrize("failure", ["refused", "stalled", "not found"])
def test_network_errors_are_one_line(
    server: Served,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    failure: str,
) -> None:
    serve(server, monkeypatch, "reddit", {"reddit.zip": zip_bytes(reddit_members())})
    if failure == "refused":
        with socket_bound_not_listening() as url:
            monkeypatch.setenv("BNSGCN_DGL_URL", url)  # the source's own variable wins over the mirror
            assert run("reddit", "--download", "--data-dir", tmp_path) == 2
        error_line(capsys, "reddit: cannot download", url, "refused", "BNSGCN_DGL_URL")
    elif failure == "stalled":
        monkeypatch.setattr(download, "TIMEOUT_S", 0.3)
        server.stall.add("/dgl/reddit.zip")
        assert run("reddit", "--download", "--data-dir", tmp_path) == 2
        error_line(capsys, "reddit", "stopped after", "no answer for 0.3 s", "reddit.zip.part")
    else:
        del server.files["/dgl/reddit.zip"]
        assert run("reddit", "--download", "--data-dir", tmp_path) == 2
        error_line(capsys, "reddit", "HTTP 404", "BNSGCN_DGL_URL")
    assert not (tmp_path / "reddit").exists()


class socket_bound_not_listening:
    """A loopback URL whose port is taken but not listening: connecting is refused."""

    def __enter__(self) -> str:
        import socket

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def __exit__(self, *exc_info: object) -> None:
        self.socket.close()


def test_refusals_before_any_request(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    serve(server, monkeypatch, "cora", planetoid_files())
    (tmp_path / "cora").mkdir()
    (tmp_path / "cora" / "ind.cora.x").write_bytes(b"mine")
    assert run("cora", "--download", "--data-dir", tmp_path) == 2
    error_line(capsys, "does not replace the existing", str(tmp_path / "cora"))
    assert (tmp_path / "cora" / "ind.cora.x").read_bytes() == b"mine"

    (tmp_path / "citeseer.download").mkdir()
    with open(tmp_path / "citeseer.download" / download.LOCK_NAME, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert run("citeseer", "--download", "--data-dir", tmp_path) == 2
    error_line(capsys, "citeseer: another process is downloading")

    assert run("npz:absent.npz", "--download", "--data-dir", tmp_path) == 2
    error_line(capsys, "absent.npz", "--download fetches only cora")
    with pytest.raises(UserError, match="download="):
        bnsgcn.partition((np.array([0, 1, 2]), np.array([1, 0])), download=True)
    assert server.requests == []


def test_the_real_cora_files_match_the_table(server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for path in SHARED_PLANETOID.glob("ind.cora.*"):
        server.files[f"/planetoid/{path.name}"] = path.read_bytes()
    source = download.resolve_or_download("cora", tmp_path, progress=False)
    assert {path.name for path in source.files} == {path.name for path in SHARED_PLANETOID.glob("ind.cora.*")}
    for path in source.files:
        assert path.read_bytes() == (SHARED_PLANETOID / path.name).read_bytes()


def test_the_table_matches_the_loaders_and_ogb(monkeypatch: pytest.MonkeyPatch) -> None:
    for source in download.SOURCES:
        monkeypatch.delenv(source.variable, raising=False)
    monkeypatch.delenv(download.MIRROR_VARIABLE, raising=False)
    for spec, entry in download.DOWNLOADS.items():
        if entry.source is download.OGB:
            meta = _metadata(spec)
            assert f"{entry.source.base_url()}/{entry.files[0].name}" == meta["url"]
            assert set(entry.expected) == {f"RELEASE_v{meta['version']}.txt", *_layouts(meta)[0]}
            assert entry.folder == spec.replace("-", "_")
        else:
            assert entry.folder == spec.removeprefix("saint:")
    assert download.DOWNLOADS["reddit"].expected == ("reddit_data.npz", "reddit_graph.npz")
    sizes = [file.size for spec in ("cora", "citeseer", "pubmed") for file in download.DOWNLOADS[spec].files]
    assert len(sizes) == 24 and sum(size is None for size in sizes) == 1


def test_byte_progress_counts_a_resumed_transfer_in_its_total_not_its_rate() -> None:
    stream = io.StringIO()
    with Progress(4 << 20, "arxiv.zip", stream, interval=0, initial=1 << 20, unit=format_bytes) as bar:
        bar.update(1 << 20)
    line = stream.getvalue().splitlines()[0]
    assert re.fullmatch(r"arxiv\.zip: 2 MiB/4 MiB \(50%\) [\d.]+ [KMG]iB/s, ETA .+", line), line
    assert format_bytes(1536) == "2 KiB" and format_bytes(300) == "300 B"


def test_downloads_stage_beside_the_target_and_keep_nothing_on_success(
    server: Served, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen = []
    original = os.rename

    def spy(source: str | Path, target: str | Path) -> None:
        seen.append((Path(source), Path(target), sorted(p.name for p in Path(source).iterdir())))
        original(source, target)

    expected = download.DOWNLOADS["yelp"].expected
    serve(server, monkeypatch, "yelp", {"yelp.zip": zip_bytes({name: b"{}" for name in expected})})
    monkeypatch.setattr(download.os, "rename", spy)
    download.fetch(download.find_download("saint:yelp"), tmp_path, "", progress=False)
    ((source, target, names),) = seen
    assert source.parent == tmp_path and source.name.startswith(".yelp.tmp-") and target == tmp_path / "yelp"
    assert names == sorted(expected)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["yelp"]
