"""Tree speculative decoding: everything between the scheduler's DRAFT chunks and the
tokens a verified tree commits.

- ``speculator``: the engine's three calls per step (``draft``, ``verify``, ``end_step``);
- ``proposer``, ``draft_worker``, ``builders``, ``merge``: growing trees with draft models;
- ``verifier``, ``verify``, ``noise``: accepting a path with the matching rule;
- ``budget``, ``adaptive``, ``sequoia``: how large trees should be;
- ``tree``, ``metrics``, ``presets``: plain data.

``SpeculativeConfig`` (in ``pagedtree.config``) is re-exported here.
"""

from pagedtree.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
