"""Accepting a path of a token tree: ``Verifier`` stages each row's outcome on the
device and walks the tree after the readback; ``rules`` holds the greedy and
stochastic acceptance rules (``RowTests``) and their result type ``VerifyResult``."""
