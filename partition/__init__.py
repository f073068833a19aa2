"""The offline partition step: datasets -> METIS/random partitions -> partition files.

Called, this package is the Python API's ``bnsgcn.partition(graph, parts, out, ...)``
(:func:`bnsgcn.partition.api.partition`, docs/api.md): the package and the function share
the name ``bnsgcn.partition``, and a module attribute cannot be both, so the package's
module is made callable.
"""

import sys
import types


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the run stops like on Ctrl-C (cleanup runs) and exits with status 143.

    ``bnsgcn-partition`` raises it from its SIGTERM handler; being a KeyboardInterrupt, every
    ``except BaseException`` / ``finally`` cleanup treats it as an interruption.
    """


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """:func:`bnsgcn.partition.api.partition` (imported on the first call: the package stays light)."""
        from .api import partition

        return partition(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
