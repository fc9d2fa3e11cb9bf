"""Token trees for speculative decoding: shapes, construction, merging, verification.

Nothing here knows about KV blocks or HTTP: the draft worker and the engine feed
draft logits in and get token trees out; the verifier gets target logits in and
returns the accepted path.
"""

from pagedtree.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
