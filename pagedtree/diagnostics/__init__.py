"""Diagnostics that give a machine a verdict: the GPU-day check.

``gpu_check`` runs, in order, the kernel correctness check (``kernel_check``, against
the dense reference of ``reference``), CUDA graphs against eager steps, greedy tree
speculation against plain decoding, the host-device sync count of a speculative step
(``engine_checks`` and ``sync_check``, on the tiny models of ``tiny_models``) and the
tree/decode kernel timings (``kernel_bench``), and prints one table (``report``); the
kernel cases run in worker processes (``case_workers``). ``pagedtree doctor
--gpu`` and ``scripts/gpu_check.sh`` run it.
"""
