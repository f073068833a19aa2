"""Which partition set to train on: the one named by ``--parts-dir``, or the one found.

Without ``--parts-dir`` the launcher looks at ``./parts`` itself and at every directory
directly inside it; a directory holding a readable ``manifest.json`` is a partition set.
The set is taken when exactly one of them has as many partitions as the job has ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bnsgcn.config import check_pool_size
from bnsgcn.data.format import MANIFEST_NAME, read_manifest
from bnsgcn.errors import UserError

DEFAULT_SEARCH_ROOT = Path("parts")


@dataclass(frozen=True)
class PartitionSet:
    """A partition-set directory and its number of partitions (= ranks it needs)."""

    path: Path
    parts: int

    def describe(self) -> str:
        return f"{self.path} ({self.parts} parts)"


def read_partition_set(path: Path) -> PartitionSet:
    """The partition set at ``path`` (:class:`UserError` when it is not one, or when its
    manifest or a partition's ``partition.json`` is malformed, inconsistent or from another set)."""
    return PartitionSet(Path(path), read_manifest(path, check_parts=True)["parts"])


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
    parts_dir: Path | None, world_size: int | None, search_root: Path = DEFAULT_SEARCH_ROOT
) -> PartitionSet:
    """The set named by ``parts_dir``, else the only set under ``search_root`` with
    ``world_size`` parts (any part count when ``world_size`` is None).

    Raises :class:`UserError` listing the candidates when none or several match.
    """
    if parts_dir is not None:
        return read_partition_set(parts_dir)
    found = find_partition_sets(search_root)
    matches = found if world_size is None else [s for s in found if s.parts == world_size]
    if len(matches) == 1:
        return matches[0]
    where = f"{search_root}/"
    if not found:
        raise UserError(
            f"no partition set found under {where}; create one with bnsgcn-partition or pass --parts-dir DIR"
        )
    wanted = "" if world_size is None else f" with {world_size} parts"
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
