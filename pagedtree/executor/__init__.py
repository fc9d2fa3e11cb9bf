"""Running the model on one process or on a tensor-parallel group of them.

- ``shards.py``: load the target (or a draft) and size its KV cache; the same
  function on every rank, each getting its own shard;
- ``tp_runner.py``: rank 0's runner, which sends each step (and each block or slot
  copy) to the other ranks before running it on its own shard;
- ``commands.py``: those messages, as int64 tensors broadcast over gloo;
- ``worker.py``: the loop of ranks 1..N-1;
- ``launcher.py``: rank 0's side of starting, watching and stopping the group.
"""
