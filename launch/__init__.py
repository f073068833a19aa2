"""The launcher ``bnsgcn-train``: starts, or joins as, the ranks of one training job.

Modules:

* :mod:`bnsgcn.launch.cli` -- the command line; picks the mode (local supervisor, or one rank
  under torchrun / SLURM) and runs the checks that must fail before any rank starts.
* :mod:`bnsgcn.launch.rank` -- the entry of one rank (``python -m bnsgcn.launch.rank``) and the error
  handling every rank shares.
* :mod:`bnsgcn.launch.supervisor` -- runs local rank processes, forwards their output and stops
  all of them as soon as one fails.
* :mod:`bnsgcn.launch.environment` -- reads the rank layout that torchrun or SLURM exported, restart
  counts, and the launch record handed to the engine (:mod:`bnsgcn.run.provenance`).
* :mod:`bnsgcn.launch.discover` -- finds the partition set to train on.
* :mod:`bnsgcn.launch.network` -- the master's address (must resolve) and port (default, in use).

``bnsgcn`` never imports ``launch``; ``launch`` imports ``bnsgcn``.
"""
