"""Keeping parameters together: gradient all-reduce, decoupled averaging, the work pool, injected delays."""
