"""What one forward leaves on the device, and its one readback to the host.

The model runner writes a ``StepOutput`` once: a draw for every plain chunk and the
logits of every token tree's rows. The verifier decides each tree's row outcomes
on the device from those logits (its own rows, returned beside). ``read_back``
then brings the draws and the tree rows to the host in one copy (a GPU step's one
sync) and returns them as a ``HostStep``; ``queue_read_back`` starts that copy
without waiting (an asynchronous step waits later, ``QueuedStep.wait``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagedtree.sampling import DeviceRows, QueuedReadBack, SampleResult, queue_read_back

# A tree's rows read back: a result per row and, for stochastic verification, which
# rows' tokens are accepted proposals.
HostRows = tuple[list[SampleResult], "list[bool] | None"]


@dataclass(slots=True)
class HostStep:
    """A step's results on the host: each plain chunk's draw, each tree's rows."""

    samples: dict[str, SampleResult] = field(default_factory=dict)
    verified_rows: dict[str, HostRows] = field(default_factory=dict)


class QueuedStep:
    """A step's readback copy, queued and not yet waited for."""

    def __init__(self, sample_ids: list[list[str]], tree_ids: list[str], queued: QueuedReadBack):
        self._sample_ids, self._tree_ids, self._queued = sample_ids, tree_ids, queued

    def wait(self) -> HostStep:
        """Wait for the copy (the step's one sync) and unpack it by request id."""
        host = self._queued.read_back()
        out = HostStep()
        for request_ids, (results, _) in zip(self._sample_ids, host):
            out.samples.update(zip(request_ids, results))
        out.verified_rows.update(zip(self._tree_ids, host[len(self._sample_ids):]))
        return out


@dataclass(slots=True)
class StepOutput:
    """What one forward produced on the device (see module docstring)."""

    sample_groups: list[tuple[list[str], DeviceRows]] = field(default_factory=list)
    verify_logits: dict[str, torch.Tensor] = field(default_factory=dict)

    def merge(self, other: StepOutput) -> None:
        """Take another (partial) step's device results in (failure isolation)."""
        self.sample_groups.extend(other.sample_groups)
        self.verify_logits.update(other.verify_logits)

    def queue_read_back(self, verify_rows: Mapping[str, DeviceRows] | None = None) -> QueuedStep:
        """Queue the one copy of every draw and of ``verify_rows`` (each tree's row
        outcomes, staged on the device); nothing waits. The device draws stay
        readable (``token_sources``) meanwhile."""
        verify_rows = dict(verify_rows or {})
        groups = [rows for _, rows in self.sample_groups] + list(verify_rows.values())
        return QueuedStep([ids for ids, _ in self.sample_groups], list(verify_rows), queue_read_back(groups))

    def read_back(self, verify_rows: Mapping[str, DeviceRows] | None = None) -> HostStep:
        """Every draw and every tree's rows on the host, in one copy."""
        return self.queue_read_back(verify_rows).wait()

    @property
    def has_rows(self) -> bool:
        """Whether the forward left anything to read back (plain draws or tree logits)."""
        return bool(self.sample_groups or self.verify_logits)

    def token_sources(self) -> dict[str, tuple[torch.Tensor, int]]:
        """Where each plain chunk's drawn token is on the device: ``(tokens, row)`` by
        request id (the next step can feed it as an input before it is read back)."""
        return {rid: (rows.tokens, i) for request_ids, rows in self.sample_groups
                for i, rid in enumerate(request_ids)}
