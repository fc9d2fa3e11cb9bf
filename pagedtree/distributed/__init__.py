"""Tensor parallelism's plain parts: how a model splits across ranks
(``layout.py``), the ranks' process group and its collectives (``group.py``), and
the commands rank 0 sends the other ranks (``commands.py``).

The processes themselves (spawning, the worker loop, the rank-0 runner) live in
``pagedtree.executor``; the models only call ``TensorParallelGroup.all_reduce`` and
``gather_to_first``.
"""
