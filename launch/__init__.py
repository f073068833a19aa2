"""The launcher ``bnsgcn-train``: starts, or joins as, the ranks of one training job.

Modules:

* :mod:`launch.cli` -- the command line; picks the mode (local supervisor, or one rank
  under torchrun / SLURM) and runs the checks that must fail before any rank starts.
* :mod:`launch.rank` -- the entry of one rank (``python -m launch.rank``) and the error
  handling every rank shares.
* :mod:`launch.supervisor` -- runs local rank processes, forwards their output and stops
  all of them as soon as one fails.
* :mod:`launch.environment` -- reads the rank layout that torchrun or SLURM exported.
* :mod:`launch.discover` -- finds the partition set to train on.
* :mod:`launch.network` -- master-port checks.

``bnsgcn`` never imports ``launch``; ``launch`` imports ``bnsgcn``.
"""
