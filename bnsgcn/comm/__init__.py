"""Communication: the process groups and collectives, wire formats, exchange plans."""
