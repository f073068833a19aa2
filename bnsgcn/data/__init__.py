"""A rank's data: the partition format, its shard, the per-epoch boundary sample."""
