"""Benchmarks of mpitrain's collectives against MPI's own, in the shape of nccl-tests.

Run under MPI, one collective per run::

    mpitrain-run -np 4 python -m benchmarks allreduce -b 8 -e 64M -f 2 -d float32 -o sum

:mod:`.harness` holds the one loop (sizes, warm-up, interleaved timing, exact
verification, table, JSON, plot); :mod:`.collectives` holds one small module of
hooks per collective (:class:`.hooks.Collective`). ``python -m benchmarks fusion``
(:mod:`.fusion`) compares fused async allreduces with one buffer and blocking calls;
:mod:`.common` holds what it and the harness share, and ``__main__`` picks between them.
"""
