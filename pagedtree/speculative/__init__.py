"""Tree speculative decoding: everything between the scheduler's DRAFT chunks and the
tokens a verified tree commits, by role.

- ``step_runner``: a scheduled plan to its result (drafting, one forward, one
  readback, verification); ``speculator``: ``propose``, ``stage``, ``accept``,
  ``observe``;
- ``drafting/``: growing trees (proposer, draft worker, builders, merge, the suffix
  drafter);
- ``verification/``: accepting a path with the matching rule (verifier, rules);
- ``budget/``: how large trees should be (policy, planner and cost model,
  acceptance tables and priors, Sequoia shapes);
- ``tree``, ``noise``, ``metrics``, ``presets``: trees and their shapes, the shared
  Gumbel noise, counters, named configurations.

``SpeculativeConfig`` (in ``pagedtree.config``) is re-exported here.
"""

from pagedtree.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
