"""Growing token trees: ``TreeProposer`` merges the trees of every ``DraftWorker``
(a draft model with its own paged KV cache; ``builders`` say which children each
level proposes) and of the model-free ``SuffixDrafter`` (``suffix_tree``)."""
