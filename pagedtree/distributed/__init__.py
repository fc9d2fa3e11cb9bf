"""Tensor parallelism's plain parts: how a model splits across ranks
(``layout.py``) and the ranks' process groups with their collectives (``group.py``).

The processes themselves (spawning, the commands rank 0 sends, the worker loop, the
rank-0 runner) live in ``pagedtree.executor``; the models only call
``TensorParallelGroup.all_reduce`` and ``gather_to_first``.
"""
