"""The model: the epoch's graph, GNN layers, the model stack, recomputation, the optimizer."""
