"""The offline partition step: datasets -> METIS/random partitions -> partition files."""
