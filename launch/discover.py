"""Which partition set to train on: the one named by ``--parts-dir``, or the one found.

Without ``--parts-dir`` the launcher looks at ``./parts`` itself and at every directory
directly inside it; a directory holding a readable ``manifest.json`` is a partition set.
The set is taken when exactly one of them has as many partitions as the job has ranks (and,
with the original BNS-GCN's ``--dataset NAME``, was made from that dataset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bnsgcn.config import check_pool_size
from bnsgcn.data.format import MANIFEST_NAME, read_manifest
from bnsgcn.errors import UserError

DEFAULT_SEARCH_ROOT = Path("parts")


@dataclass(frozen=True)
class PartitionSet:
    """A partition-set directory, its number of partitions (= ranks it needs) and the
    dataset it was made from (bnsgcn-partition's DATASET argument)."""

    path: Path
    parts: int
    dataset: str = field(default="", compare=False)  # a set is its directory and parts

    def describe(self) -> str:
        return f"{self.path} ({self.parts} parts)"


def read_partition_set(path: Path) -> PartitionSet:
    """The partition set at ``path`` (:class:`UserError` when it is not one, or when its
    manifest or a partition's ``partition.json`` is malformed, inconsistent or from another set)."""
    manifest = read_manifest(path, check_parts=True)
    spec = manifest["dataset"].get("spec") if isinstance(manifest.get("dataset"), dict) else None
    return PartitionSet(Path(path), manifest["parts"], spec if isinstance(spec, str) else "")


def find_partition_sets(root: Path = DEFAULT_SEARCH_ROOT) -> list[PartitionSet]:
    """Partition sets at ``root`` and one level below it, in name order.

    Directories whose manifest cannot be read are skipped: they are not usable sets, and
    naming one with ``--parts-dir`` reports why.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    directories = [root, *sorted(entry for entry in root.iterdir() if entry.is_dir())]
    found: list[PartitionSet] = []
    for directory in directories:
        if not (directory / MANIFEST_NAME).is_file():
            continue
        try:
            found.append(read_partition_set(directory))
        except UserError:
            continue
    return found


def choose_partition_set(
    parts_dir: Path | None,
    world_size: int | None,
    search_root: Path = DEFAULT_SEARCH_ROOT,
    dataset: str | None = None,
) -> PartitionSet:
    """The set named by ``parts_dir``, else the only set under ``search_root`` with
    ``world_size`` parts (any part count when ``world_size`` is None) made from ``dataset``
    (any when None; names compare case-insensitively, as bnsgcn-partition reads them).

    Raises :class:`UserError` listing the candidates when none or several match.
    """

    def made_from(s: PartitionSet) -> bool:
        return dataset is None or s.dataset.lower() == dataset.lower()

    if parts_dir is not None:
        chosen = read_partition_set(parts_dir)
        if not made_from(chosen):
            raise UserError(
                f"partition set {parts_dir} was made from {chosen.dataset or 'an unnamed dataset'}, not --dataset "
                f"{dataset}; drop --dataset or pass the set made from {dataset}"
            )
        return chosen
    found = find_partition_sets(search_root)
    matches = [s for s in found if (world_size is None or s.parts == world_size) and made_from(s)]
    if len(matches) == 1:
        return matches[0]
    where = f"{search_root}/"
    if not found:
        raise UserError(
            f"no partition set found under {where}; create one with bnsgcn-partition or pass --parts-dir DIR"
        )
    wanted = ("" if world_size is None else f" with {world_size} parts") + (
        "" if dataset is None else f" made from {dataset}"
    )
    if not matches:
        listing = ", ".join(s.describe() for s in found)
        raise UserError(
            f"no partition set{wanted} under {where} (found: {listing}); pass --parts-dir DIR, or as many ranks as a "
            "set has parts"
        )
    listing = ", ".join(s.describe() for s in matches)
    raise UserError(f"{len(matches)} partition sets{wanted} under {where}: {listing}; choose one with --parts-dir DIR")


def check_world_size(partition_set: PartitionSet, world_size: int, work_pool: bool = False) -> None:
    """Every rank trains exactly one partition: the counts must agree (with a work pool,
    at least one partition per rank)."""
    if work_pool:
        check_pool_size(partition_set.parts, world_size, partition_set.path)
        return
    if partition_set.parts != world_size:
        k = partition_set.parts
        raise UserError(
            f"{world_size} ranks but partition set {partition_set.path} has {k} partitions; "
            f"run {k} ranks (e.g. --procs {k} on one machine) or re-partition into {world_size} parts with "
            "bnsgcn-partition"
        )
