"""The offline partition step: datasets -> METIS/random partitions -> partition files."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the run stops like on Ctrl-C (cleanup runs) and exits with status 143.

    ``bnsgcn-partition`` raises it from its SIGTERM handler; being a KeyboardInterrupt, every
    ``except BaseException`` / ``finally`` cleanup treats it as an interruption.
    """
