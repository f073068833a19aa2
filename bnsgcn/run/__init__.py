"""A training run: the train loop, evaluation, checkpoints, stopping, provenance."""
