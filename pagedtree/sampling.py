"""Turning logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded draws.

The processing is split from the draw so that tree verification can compute the
exact target distribution the plain sampler would draw from and run its acceptance
tests against it.

Two ways to draw a token of a sampling request:

- **Seeded requests** (``SamplingParams.seed`` set) draw by the Gumbel-max trick,
  ``argmax(log p + g)``, with noise ``g`` keyed by (seed, output position) alone: a
  counter-based SplitMix64 stream per key (``uniform_streams``), generated for all of
  a batch's seeded rows in one parallel call.
  The token at a position is then a function of the seed and the distribution
  there, nothing else: not the batch, not preemptions, and not speculation, whose
  verifier computes the same draw at every tree node (``coupled`` verification).
- **Other requests** draw by inverse transform from the request's own random
  stream, one uniform number per token (cheaper: no noise over the vocabulary).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedtree.sampling_params import SamplingParams
from pagedtree.structured.matcher import apply_bitmasks
from pagedtree.uploads import to_device, upload

# Keys that separate the random streams derived from one request seed.
NOISE_STREAM = 1  # Gumbel noise of seeded draws, per output position
DRAFT_STREAM = 2  # a draft model's random children, per draft model
VERIFY_STREAM = 3  # the acceptance tests of tree verification


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for the random stream named by ``keys`` under ``seed``.

    A cryptographic hash, so streams of nearby seeds and keys are unrelated (seeding
    generators with ``seed + i`` or ``seed ^ salt`` gives correlated or, across
    draft models, identical streams).
    """
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# SplitMix64 (Steele, Lea and Flood 2014): the generator's output for counter j of a
# stream is mix(key + (j + 1) * GAMMA), so any entry of a stream can be computed on
# its own, in any order and in parallel.
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB


def _splitmix_uniform_numpy(keys: np.ndarray, vocab_size: int) -> np.ndarray:
    """``[len(keys), vocab_size]`` float32 uniforms in (0, 1): numpy, the reference."""
    j = np.arange(1, vocab_size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64)[:, None] + j[None, :] * np.uint64(_SPLITMIX_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_SPLITMIX_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_SPLITMIX_M2)
    z = z ^ (z >> np.uint64(31))
    # 23 high bits, centred in their cell: strictly inside (0, 1) in float32, so the
    # Gumbel transform never sees 0 or 1.
    return ((z >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)


try:
    from numba import njit, prange

    from pagedtree.numba_cache import use_shared_cache

    use_shared_cache()  # before the kernel below is decorated

    @njit(cache=True, nogil=True, inline="always")
    def _splitmix_row(key, out):  # pragma: no cover - compiled
        key = np.uint64(key)
        for j in range(out.shape[0]):
            z = key + np.uint64(j + 1) * np.uint64(_SPLITMIX_GAMMA)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(_SPLITMIX_M1)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(_SPLITMIX_M2)
            z = z ^ (z >> np.uint64(31))
            out[j] = (np.float32(z >> np.uint64(41)) + np.float32(0.5)) * np.float32(2.0**-23)

    @njit(parallel=True, cache=True, nogil=True)
    def _splitmix_uniform_kernel(keys, out):  # pragma: no cover - compiled
        for r in prange(out.shape[0]):
            _splitmix_row(keys[r], out[r])

    @njit(cache=True, nogil=True)
    def _splitmix_uniform_serial(keys, out):  # pragma: no cover - compiled
        for r in range(out.shape[0]):
            _splitmix_row(keys[r], out[r])

except ImportError:  # numba is optional: the numpy path gives the same numbers, slower
    _splitmix_uniform_kernel = _splitmix_uniform_serial = None

# Fewer rows than this are drawn on the calling thread: waking the parallel kernel's
# threads cost one row (a single stream's token) 3x the row itself (74 against 23 us
# for 151,936 ids).
_PARALLEL_ROWS = 4


def uniform_streams(keys: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[len(keys), vocab_size]`` float32 uniforms in (0, 1), row ``i`` the first
    ``vocab_size`` outputs of the SplitMix64 stream ``keys[i]`` (a function of the key
    alone; numba when it imports, else numpy, with identical results)."""
    key_array = np.asarray([k & 0xFFFFFFFFFFFFFFFF for k in keys], dtype=np.uint64)
    if _splitmix_uniform_kernel is None:
        return torch.from_numpy(_splitmix_uniform_numpy(key_array, vocab_size))
    out = np.empty((len(key_array), vocab_size), dtype=np.float32)
    kernel = _splitmix_uniform_kernel if len(key_array) >= _PARALLEL_ROWS else _splitmix_uniform_serial
    kernel(key_array, out)
    return torch.from_numpy(out)


def gumbel_noise_rows(
    seeds_and_positions: Sequence[tuple[int, int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Standard Gumbel noise ``[N, vocab_size]``, row ``i`` that of the seeded request
    ``seeds_and_positions[i] = (seed, output position)``.

    Each row is a counter-based stream keyed by (seed, position) (``uniform_streams``):
    about 20x cheaper than seeding a Mersenne Twister per row, which made the noise
    the largest cost of seeded sampling at batch 32.
    """
    keys = [stream_seed(seed, NOISE_STREAM, position) for seed, position in seeds_and_positions]
    u = to_device(uniform_streams(keys, vocab_size), torch.device(device))
    return u.log_().neg_().log_().neg_()  # -log(-log u), in place


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard Gumbel noise ``[vocab_size]`` of a seeded request at output ``position``."""
    return gumbel_noise_rows([(seed, position)], vocab_size, device)[0]


def coupled_tokens(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draws ``argmax(log probs + noise)`` along the last dimension.

    With standard Gumbel noise each draw follows ``probs`` exactly; tokens of
    probability zero (log = -inf) are never drawn.
    """
    return torch.argmax(torch.log(probs) + noise, dim=-1)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    history: Sequence[int]  # prompt + output tokens, for the repetition penalty
    num_output_tokens: int  # generated so far, for min_tokens (and the noise position)
    generator: torch.Generator | None  # inverse-transform stream; None for greedy and seeded rows
    coupling_seed: int | None = None  # seeded rows: Gumbel-max with this seed's noise
    bitmask: torch.Tensor | None = None  # [W] int32: the tokens a grammar allows (None: all)


class NonFiniteDistributionError(RuntimeError):
    """A row's next-token distribution was not finite (NaN or infinite logits), so no
    token can be drawn from it; the request fails, the batch carries on."""

    def __init__(self) -> None:
        super().__init__("the model's next-token distribution is not finite (NaN or infinite logits); "
                         "no token can be drawn")


@dataclass(slots=True)
class SampleResult:
    """The token drawn for one row, its raw logprob, and the top raw logprobs asked for;
    ``valid`` is False when the row's distribution was not finite (the token means
    nothing then, and the request must fail)."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None
    valid: bool = True


# Penalised logits are kept within +-1e30: divided by the smallest temperature (1e-5)
# they stay finite in fp32 (3.4e38), so no penalty, however tiny or huge, can turn a
# row into infinities (and its softmax into NaN).
PENALISED_LOGIT_LIMIT = 1e30
# What min_tokens leaves a stop token's logit: far below any other finite logit (a
# penalised one stops at -1e30), so the stop has probability 0 wherever anything else
# may be drawn, yet finite (still finite over a 1e-5 temperature), so that where a
# grammar or the stop list allows nothing else the stop is drawn and the output ends,
# instead of a row of -inf that no token can be drawn from.
MIN_TOKENS_STOP_LOGIT = -1e33


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty and min_tokens suppression, in place on fp32 ``logits``."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.history:
            seen = host_index(sorted(set(row.history)), logits.device)
            # float64: a penalty such as 1e-300 is 0 in fp32 (x / 0 = inf, 0 * inf = NaN).
            values = logits[i, seen].double()
            # Same rule as transformers and vLLM: shrink positive logits, grow negative ones.
            penalised = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            limit = PENALISED_LOGIT_LIMIT
            logits[i, seen] = penalised.clamp_(-limit, limit).to(logits.dtype)
        if row.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(p.eos_token_ids))
            if banned:
                stops = host_index(banned, logits.device)
                logits[i, stops] = logits[i, stops].clamp(max=MIN_TOKENS_STOP_LOGIT)  # (an -inf stays)
    return logits


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from ``probs [V]`` (any non-negative weights) by inverse transform.

    One uniform number and a float64 cumulative sum: exact like ``torch.multinomial``
    and about 12x faster on a CPU, where drawing ``V`` random numbers (multinomial,
    or the exponential race) dominates (49k vocabulary: 0.09 ms against 1.2 ms).
    A token of probability zero is never drawn: the search returns the first index
    whose cumulative sum exceeds ``u``, which is a strict increase.
    """
    return int(draw_token_tensor(probs.reshape(1, -1), [generator])[0])


def draw_token_tensor(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``draw_token`` for every row of ``probs [N, V]``, row ``i`` from ``generators[i]``,
    as a device tensor ``[N]`` (no host sync).

    Each row takes exactly one uniform number from its own generator, so a request's
    stream does not depend on its neighbours; the sums and searches run batched. The
    search target stays strictly below the row's total (the largest double under it
    at most), so the search always lands on a token with mass, the last one when
    ``u`` rounds up to the total.
    """
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    return inverse_transform(probs, u)


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [N, V]`` (non-negative weights) from the float64
    uniforms ``u [N]``: the first index whose cumulative sum (float64) exceeds
    ``u`` times the row's total, on the device.

    A row whose total is not a positive finite number (NaN or infinite weights, or
    none at all) has no token: it gets ``V``, outside the vocabulary, which
    ``row_results`` reports as an invalid row instead of indexing with it.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    totals = cdf[:, -1:]
    target = torch.minimum(u.reshape(-1, 1) * totals, torch.nextafter(totals, torch.zeros_like(totals)))
    tokens = torch.searchsorted(cdf, target, right=True).reshape(-1)
    usable = torch.isfinite(totals).reshape(-1) & (totals.reshape(-1) > 0)
    return torch.where(usable, tokens, probs.shape[-1])


def coupled_draws(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """The seeded (Gumbel-max) tokens of processed fp32 ``logits [N, V]`` with ``noise
    [N, V]``: ``argmax(log p + noise)`` with ``p = target_probs(logits, params)``.

    Plain decoding and coupled tree verification both draw through this function, so
    their tokens agree bit for bit. Without top-k, top-p or min-p, ``log p`` is
    ``logits / T`` minus a per-row constant, so the draw skips the softmax:
    ``argmax(logits / T + noise)``, two passes instead of six (separate division and
    addition, each correctly rounded whatever the batching).
    """
    unfiltered = params.top_k <= 0 or params.top_k >= logits.shape[-1]
    if unfiltered and params.top_p >= 1.0 and params.min_p <= 0.0:
        return torch.argmax((logits / params.temperature).add_(noise), dim=-1)
    return coupled_tokens(target_probs(logits, params), noise)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row is drawn from, for fp32 (penalised) ``logits [.., V]``."""
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -float("inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        # Explicitly: a top_p that rounds to 0 in fp32 would otherwise drop everything.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def needs_penalties(row: SamplingRow) -> bool:
    """Whether ``apply_penalties`` changes this row (repetition penalty or min_tokens)."""
    p = row.params
    return (p.repetition_penalty != 1.0 and bool(row.history)) or row.num_output_tokens < p.min_tokens


@dataclass(slots=True)
class DeviceRows:
    """Per-row results still on the device: a token per row, its raw logprob, and the
    top raw logprobs (ids and values, at the largest ``k`` asked for) when any row
    wants them. ``read_back`` brings any number of these to the host in one copy.

    ``accepted`` (stochastic tree verification only) says whether the row's token is
    one of its proposals that passed its test, rather than a draw from the residual.
    """

    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] raw logprob of each token
    ks: list[int | None]  # top logprobs asked for, per row (None: none reported)
    top_ids: torch.Tensor | None = None  # [N, k_max]
    top_values: torch.Tensor | None = None  # [N, k_max]
    accepted: torch.Tensor | None = None  # [N] bool
    valid: torch.Tensor | None = None  # [N] bool: a token from a finite distribution

    @property
    def num_rows(self) -> int:
        """Rows held."""
        return len(self.ks)

    def packed(self) -> list[torch.Tensor]:
        """Every value as flat float64 (token ids and flags are exact in float64)."""
        out = [self.tokens.to(torch.float64), self.logprobs.to(torch.float64)]
        if self.top_ids is not None and self.top_values is not None:
            out += [self.top_ids.to(torch.float64).reshape(-1), self.top_values.to(torch.float64).reshape(-1)]
        if self.accepted is not None:
            out.append(self.accepted.to(torch.float64))
        if self.valid is not None:
            out.append(self.valid.to(torch.float64))
        return out

    def unpack(self, host: Sequence[float]) -> tuple[list[SampleResult], list[bool] | None]:
        """The host values of ``packed()``: a ``SampleResult`` per row, and the flags."""
        n = self.num_rows
        k_max = 0 if self.top_ids is None else self.top_ids.shape[1]
        flags_at = 2 * n + 2 * n * k_max
        valid_at = flags_at + (n if self.accepted is not None else 0)
        results = []
        for i, k in enumerate(self.ks):
            token, logprob = int(host[i]), host[n + i]
            top = None
            if k is not None:
                top = {}
                if k > 0:
                    ids_at, values_at = 2 * n + i * k_max, 2 * n + n * k_max + i * k_max
                    top = {int(t): v for t, v in zip(host[ids_at:ids_at + k], host[values_at:values_at + k])}
                top[token] = logprob
            valid = self.valid is None or bool(host[valid_at + i])
            results.append(SampleResult(token, logprob, top, valid))
        flags = None
        if self.accepted is not None:
            flags = [bool(x) for x in host[flags_at:flags_at + n]]
        return results, flags


def row_results(tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, ks: Sequence[int | None],
                accepted: torch.Tensor | None = None, logits: torch.Tensor | None = None) -> DeviceRows:
    """``DeviceRows`` for ``tokens [N]`` chosen from rows of ``raw_logprobs [N, V]``,
    with the top logprobs each row asks for (``ks``); nothing leaves the device.
    Without ``raw_logprobs`` (no row asks for logprobs: no ``log_softmax`` is
    written) the rows' fp32 ``logits`` decide validity and every logprob is 0.

    A row is valid when its token is inside the vocabulary (a draw from a
    distribution that was not finite is not: ``inverse_transform``) and the model's
    logprob of it is finite (NaN or infinite logits are not: without logprobs, the
    row's largest logit is finite); an invalid row's token is clamped into the
    vocabulary so that nothing indexes outside it, and its request is failed by
    whoever reads it (``SampleResult.valid``).
    """
    vocab = (raw_logprobs if raw_logprobs is not None else logits).shape[-1]
    in_range = (tokens >= 0) & (tokens < vocab)
    tokens = tokens.clamp(0, vocab - 1)
    if raw_logprobs is None:
        chosen = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        finite = torch.isfinite(logits.amax(dim=-1))
    else:
        chosen = raw_logprobs.gather(1, tokens.reshape(-1, 1)).reshape(-1)
        finite = torch.isfinite(chosen)
    rows = DeviceRows(tokens, chosen, list(ks), accepted=accepted, valid=in_range & finite)
    k_max = max((k for k in ks if k is not None), default=0)
    if k_max > 0:
        rows.top_values, rows.top_ids = torch.topk(raw_logprobs, k_max, dim=-1)
    return rows


class QueuedReadBack:
    """Rows whose one device-to-host copy is queued (``queue_read_back``) but not yet
    waited for: on CUDA a non-blocking copy into pinned memory and an event behind
    it, so the host can queue more work (the next step) before it waits; on a CPU
    the values are there already."""

    def __init__(self, groups: Sequence[DeviceRows]):
        self.groups = list(groups)
        self.packed = [group.packed() for group in self.groups]
        flat = [t for tensors in self.packed for t in tensors]
        self.event = None
        if not flat:
            self.host = None
            return
        values = torch.cat(flat)
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def read_back(self) -> list[tuple[list[SampleResult], list[bool] | None]]:
        """Wait for the copy (the step's one sync) and unpack every group's rows."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host.tolist() if self.host is not None else []
        out = []
        offset = 0
        for group, tensors in zip(self.groups, self.packed):
            size = sum(t.numel() for t in tensors)
            out.append(group.unpack(host[offset:offset + size]))
            offset += size
        return out


def queue_read_back(groups: Sequence[DeviceRows]) -> QueuedReadBack:
    """Queue the one device-to-host copy of every group's rows; its ``read_back()`` waits."""
    return QueuedReadBack(groups)


def read_back(groups: Sequence[DeviceRows]) -> list[tuple[list[SampleResult], list[bool] | None]]:
    """Bring every group's rows to the host in one device-to-host copy (a GPU step's
    one sync); per group, its results and its flags (see ``DeviceRows.unpack``)."""
    return queue_read_back(groups).read_back()


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceRows:
    """Draw one token per row of ``logits [N, V]``, on the logits' device.

    Greedy rows share one argmax; sampling rows with the same parameters share one
    distribution and one batched draw (3x faster than row by row at 32 x 49k, once
    the host allocator keeps the buffers mapped); the logits are copied only when a
    row has penalties to apply. Nothing is read back: the tokens, their logprobs and
    any top logprobs asked for stay on the device until ``read_back``.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
    logits = logits.float()
    device = logits.device
    # Logprobs only where a row reports them (a log_softmax writes a whole fp32 row).
    wanted = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wanted else None
    # Penalties and grammar masks edit a copy: the raw logits stay for the reported logprobs.
    masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
    penalised = any(map(needs_penalties, rows))
    processed = logits.clone() if masked or penalised else logits
    if penalised:
        apply_penalties(processed, rows)
    apply_bitmasks(processed, masked, [rows[i].bitmask for i in masked])
    tokens = torch.zeros(len(rows), dtype=torch.long, device=device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        _put(tokens, greedy, _rows_of(processed, greedy).argmax(dim=-1))
    # Sampling rows with the same parameters share one distribution computation; each
    # row then draws on its own terms (its seed's noise, or its own generator).
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if not row.params.greedy:
            p = row.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    for group in groups.values():
        params = rows[group[0]].params
        seeded = [i for i in group if rows[i].coupling_seed is not None]
        drawn = [i for i in group if rows[i].coupling_seed is None]
        if seeded:
            noise = gumbel_noise_rows([(rows[i].coupling_seed, rows[i].num_output_tokens) for i in seeded],
                                      logits.shape[-1], device)
            _put(tokens, seeded, coupled_draws(_rows_of(processed, seeded), params, noise))
        if drawn:
            probs = target_probs(_rows_of(processed, drawn), params)
            _put(tokens, drawn, draw_token_tensor(probs, [rows[i].generator for i in drawn]))
    return row_results(tokens, raw_logprobs, [r.params.logprobs for r in rows], logits=logits)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
    """``sample_rows`` read back at once: one token per row with its logprob and the
    top logprobs asked for (one device sync)."""
    return read_back([sample_rows(logits, rows)])[0][0]


def _put(tokens: torch.Tensor, indices: list[int], values: torch.Tensor) -> None:
    """``tokens[indices] = values``, the index uploaded without a host sync."""
    if len(indices) == tokens.shape[0]:  # every row, in order (indices are ascending)
        tokens.copy_(values)
        return
    tokens[host_index(indices, tokens.device)] = values


def host_index(indices: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device`` from host ints, queued without a host sync."""
    return upload(indices, torch.long, device)


def _rows_of(x: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``x[indices]``, without a copy when ``indices`` is every row in order."""
    if len(indices) == x.shape[0] and indices == list(range(len(indices))):
        return x
    return x[host_index(indices, x.device)]
