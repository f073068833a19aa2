"""bnsgcn: partition-parallel full-graph GNN training with random boundary node sampling."""

__version__ = "0.1.0"
