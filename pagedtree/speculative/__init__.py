"""Tree speculative decoding: everything between the scheduler's DRAFT chunks and the
tokens a verified tree commits.

- ``step_runner``: a scheduled plan to its result (drafting, one forward, one readback,
  verification); ``speculator``: ``propose``, ``stage``, ``accept``, ``observe``;
- ``proposer``, ``draft_worker``, ``builders``, ``merge``: growing trees with draft models;
- ``verifier``, ``verify``, ``noise``: accepting a path with the matching rule;
- ``budget``, ``adaptive``, ``sequoia``: how large trees should be;
- ``tree``, ``metrics``, ``presets``: plain data.

``SpeculativeConfig`` (in ``pagedtree.config``) is re-exported here.
"""

from pagedtree.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
