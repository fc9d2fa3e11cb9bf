"""Serving benchmarks: a load generator for OpenAI-completions and TGI servers.

``metrics`` holds the metric definitions (pure functions, no I/O), ``datasets`` the
prompt sources, ``backends`` one streaming HTTP request per protocol, and
``serving`` the driver (``python -m pagedtree.loadgen.serving``, ``pagedtree bench
serve`` or ``benchmarks/serving.py``).
"""
