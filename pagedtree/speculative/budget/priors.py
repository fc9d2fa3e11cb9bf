"""Acceptance priors: what the adaptive budget expects of a draft before the run has
measured its own acceptance (``acceptance.AcceptanceTable`` starts from them)."""

from __future__ import annotations

# Acceptance priors: conditional acceptance rates by depth (rows, 1 first) and rank
# (columns), for greedy and for sampling requests, that the adaptive budget starts
# from before the run has measured its own (``acceptance.AcceptanceTable``).
# ``PAIR_PRIORS`` were measured on the packaged pairs (benchmarks/acceptance_prior.py,
# recorded in benchmarks/RESULTS.md); ``DEFAULT_PRIORS`` are for other pairs, and their
# "suffix" entry starts the class tables of an engine whose only drafter is the suffix
# drafter (what ``acceptance_rates_by_depth`` reports there): its trees are priced by
# the match they follow, from ``suffix_acceptance.SUFFIX_MATCH_PRIORS``.
AcceptancePrior = dict[str, list[list[float]]]

DEFAULT_PRIORS: dict[str, AcceptancePrior] = {
    "model": {
        "greedy": [[0.7, 0.3, 0.15], [0.75, 0.3, 0.15], [0.78, 0.3, 0.15], [0.8, 0.3, 0.15]],
        "sampling": [[0.55, 0.25, 0.12], [0.6, 0.25, 0.12], [0.62, 0.25, 0.12], [0.65, 0.25, 0.12]],
    },
    "suffix": {
        "greedy": [[0.5, 0.2, 0.1], [0.65, 0.2, 0.1], [0.7, 0.2, 0.1], [0.75, 0.2, 0.1]],
        "sampling": [[0.35, 0.15, 0.08], [0.5, 0.15, 0.08], [0.55, 0.15, 0.08], [0.6, 0.15, 0.08]],
    },
}

PAIR_PRIORS: dict[tuple[str, str], AcceptancePrior] = {
    # bf16, coding and prose prompts, a static (2,2,1,1,1,1) tree, 64 tokens per
    # request; sampling at temperature 0.8 (without-replacement draws). Ranks with
    # fewer than 20 trials: half the rank above.
    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"): {
        "greedy": [[0.725, 0.386, 0.193], [0.745, 0.49, 0.245], [0.775, 0.388, 0.194], [0.832, 0.416, 0.208],
                   [0.837, 0.418, 0.209], [0.855, 0.427, 0.213]],
        "sampling": [[0.794, 0.543, 0.272], [0.808, 0.474, 0.237], [0.807, 0.404, 0.202], [0.805, 0.403, 0.202],
                     [0.787, 0.394, 0.197], [0.855, 0.427, 0.213]],
    },
}


def acceptance_prior(target: str | None, drafts: list[str] | None, drafter: str) -> AcceptancePrior:
    """The prior for a target and its drafts (names or paths): the measured one of a
    packaged pair, else the default of the drafter kind."""
    if drafts and drafter != "suffix":
        key = (_name(target), _name(drafts[0]))
        if key in PAIR_PRIORS:
            return PAIR_PRIORS[key]
        return DEFAULT_PRIORS["model"]
    return DEFAULT_PRIORS["suffix"]


def _name(model: str | None) -> str:
    """A packaged model's name from a name or a path ('.../qwen2.5-coder-0.5b-instruct')."""
    return (model or "").rstrip("/").rsplit("/", 1)[-1].lower()
