"""Structured outputs: grammars compiled from a request's constraint
(``pagedtree.structured_params``), and the per-request state that masks its tokens.

- ``grammars``: compile (in a worker process that can be stopped), cache, share;
- ``matcher``: one request's state, its masks at the committed end and at every
  node of a token tree, the tokens a grammar forces;
- ``compile_worker``: the worker process.
"""

from pagedtree.structured.grammars import Grammars
from pagedtree.structured.matcher import RequestGrammar, apply_bitmasks

__all__ = ["Grammars", "RequestGrammar", "apply_bitmasks"]
