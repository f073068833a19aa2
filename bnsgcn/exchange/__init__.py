"""Boundary exchange strategies: how sampled boundary rows and their gradients move each epoch."""
