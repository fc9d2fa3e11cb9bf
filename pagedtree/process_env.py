"""Environment variables the package sets for its own process, and the environment
without them for other programs it starts.

Importing pagedtree sets a few defaults that native libraries read once at start-up
(OpenMP's wait policy, oneDNN's cache sizes), each only where the environment does
not set it already. Child processes inherit ``os.environ``: a benchmark that starts
another engine (llama.cpp, vLLM) from a process that imported pagedtree would hand
that engine pagedtree's settings. ``OMP_WAIT_POLICY=PASSIVE`` makes an OpenMP build
of llama.cpp put its threads to sleep after every operation of a forward, which cost
it about a third of its single-stream speed on a 2-core machine (benchmarks/RESULTS.md).
``foreign_environment`` is the environment as it was before those defaults.
"""

from __future__ import annotations

import os

# name -> the value this package set, for every name it set because it was unset.
_SET_HERE: dict[str, str] = {}


def set_default(name: str, value: str) -> None:
    """``os.environ[name] = value`` unless the environment already sets ``name``;
    a value set here is remembered (see ``foreign_environment``)."""
    if name not in os.environ:
        os.environ[name] = value
        _SET_HERE[name] = value


def foreign_environment() -> dict[str, str]:
    """``os.environ`` without the defaults pagedtree set in this process (a variable
    changed since by someone else is kept as it is now): the environment to start
    another engine with."""
    return {name: value for name, value in os.environ.items() if _SET_HERE.get(name) != value}
