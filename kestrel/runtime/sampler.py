"""Turning logits into tokens on the device, for the whole batch at once: greedy, temperature, top-k, top-p, min-p,
an optional grammar bitmask, and logprobs.

Random numbers are counter-based: each row's draws are hashed from (request seed, token position), so a seeded
request gets the same tokens alone or in any batch, in any order, with no generator state to keep.

Filters, in this order (vLLM's): temperature, top-k (the first k tokens in the canonical order: logit descending,
token id ascending), top-p on the distribution renormalised after top-k (a token is kept while the mass before it
is below top_p; the first token is always kept), min-p (keep p >= min_p * max p). All three keep a prefix of the
canonical order. Greedy rows (temperature below `sampling_params.GREEDY_BELOW`) take the argmax. On CUDA every
sampled row goes through the Triton kernels of `kernels/sampling/nucleus.py`: each row split into chunks across the
SMs, a radix select of the k-th key, exponential-race (Gumbel-max) proposals from the prefix min-p and top-k leave, exact rejection
against top-p, a bisection fallback; no sort. On the CPU (and the `*_sort` benchmark kinds) the torch paths below,
which the kernels are tested against, draw with one uniform per row by inverse CDF in two levels (blocks of `BLOCK`
tokens, then inside the chosen block) with float64 running sums:
- plain rows (temperature only): over the whole vocabulary in vocabulary order;
- top-k rows with k <= `TOP_K_CAP`: `torch.topk` of `TOP_K_CAP` candidates, re-sorted canonically; exact whenever
  the k-th largest logit is larger than the `TOP_K_CAP`-th (a tie exactly there is broken by topk's own order);
- top-p / min-p rows without top-k (`NUCLEUS`) and `SORTED` rows (a top-k above `TOP_K_CAP`): one full stable sort
  of the row.
Each path runs only when a row of the step needs it, over all rows (static shapes), and each row takes its own
path's token, so a row's draw never depends on the other rows.

`Sampler` keeps every per-row parameter in persistent device buffers written by one host->device copy per step
(`prepare`); `Sampler.sample` then makes no host sync and allocates nothing that depends on data, so it can be
captured in a CUDA graph for a fixed batch size and `StepFlags`. The engine copies the result back once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kestrel.kernels.sampling.nucleus import NucleusWork, chunk_block, nucleus_draw
from kestrel.runtime.inputs import PinnedStaging
from kestrel.sampling_params import SamplingParams

TOP_K_CAP = 1024
BLOCK = 1024                    # tokens per block of the two-level inverse-CDF draw
MASK32 = 0xFFFFFFFF
PLAIN, TOP_K, SORTED, GREEDY, NUCLEUS = 0, 1, 2, 3, 4      # a row's path
_INTS, _FLOATS = 5, 3           # packed fields: key0, key1, position, top_k, path | temperature, top_p, min_p

log = logging.getLogger("kestrel.sampler")


# ---- counter-based uniforms: the same code on Python ints (host keys) and int64 tensors (device) --------------
def mix32(x):
    """A 32-bit integer finaliser (xorshift-multiply, two rounds): every input bit affects every output bit. The
    multipliers are odd and below 2**31, so a product of a 32-bit value fits int64 exactly (no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & MASK32
    return x ^ (x >> 16)


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of a request's seed (any Python int: taken mod 2**64)."""
    s = seed % (1 << 64)
    return mix32(s & MASK32), mix32(((s >> 32) & MASK32) ^ 0x9E3779B9)


def uniforms(key0: torch.Tensor, key1: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) with 53 random bits (float64), a function of (keys, position) only."""
    w1 = mix32(mix32((position & MASK32) ^ key0) ^ key1)
    w2 = mix32(w1 ^ 0x68E31DA4)
    return ((w1 >> 5) * (1 << 26) + (w2 >> 6)).double() * (2.0 ** -53)


# ---- the pieces of a step --------------------------------------------------------------------------------------
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where the bit of a token is 0. `bitmask` int32 [B, ceil(V / 32)]: bit j of word w allows token 32 w + j."""
    B, V = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(B, -1)[:, :V].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def draw(weights: torch.Tensor, u: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Index per row, drawn with probability weights / row sum (weights >= 0, not normalised), by inverse CDF with
    the row's uniform u: the block whose running sum first passes u * total, then the token inside it. A zero
    weight is never drawn."""
    B, N = weights.shape
    block = min(block or BLOCK, N)
    nb = -(-N // block)
    if nb * block != N:
        weights = torch.nn.functional.pad(weights, (0, nb * block - N))
    blocks = weights.view(B, nb, block)
    bcum = blocks.sum(-1, dtype=torch.float64).cumsum(-1)                           # [B, nb]
    target = (u * bcum[:, -1]).unsqueeze(1)
    bi = torch.searchsorted(bcum, target, right=True).clamp_(max=nb - 1)          # [B, 1]
    before = torch.where(bi > 0, bcum.gather(1, (bi - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, bi.unsqueeze(-1).expand(B, 1, block)).squeeze(1)     # [B, block]
    icum = inner.double().cumsum(-1)
    j = torch.searchsorted(icum, target - before, right=True)
    # rounding may put the target just past the block's own running sum: take its last positive weight then
    last = ((inner > 0) * torch.arange(1, block + 1, device=inner.device)).amax(-1, keepdim=True) - 1
    j = torch.minimum(j, last.clamp(min=0))
    return (bi * block + j).squeeze(1)


def canonical_candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per row in the canonical order (value descending, token id ascending): values, ids."""
    if k >= x.shape[1]:
        vals, ids = x.sort(dim=-1, descending=True, stable=True)
        return vals, ids
    vals, ids = x.topk(k, -1)
    ids, by_id = ids.sort(-1)
    vals, order = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def keep_weights(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Unnormalised kept probabilities over canonical candidates `vals` [B, K] (scaled logits, sorted): top-k, then
    top-p on the renormalised top-k distribution, then min-p; rank 0 is always kept. A row's `top_k` >= K keeps all."""
    K = vals.shape[1]
    top = vals[:, :1]
    pc = torch.exp(vals - torch.where(torch.isfinite(top), top, 0.0))   # relative to the max: the first is 1
    rank = torch.arange(K, device=vals.device).unsqueeze(0)
    first = rank == 0
    keep = rank < top_k.unsqueeze(1)
    pk = pc * keep
    cum = pk.double().cumsum(-1)
    before = (cum - pk) / cum[:, -1:]
    keep &= (before < top_p.unsqueeze(1)) | first
    keep &= (pc >= min_p.unsqueeze(1)) | first
    return pc * keep


@dataclass(frozen=True)
class StepFlags:
    """What one step needs, known on the host from the rows' parameters (part of a CUDA-graph key)."""
    paths: frozenset          # the row paths present
    top_logprobs: int | None  # top-n logprobs to return (max over rows), None: no logprobs this step


@dataclass
class SampleResult:
    token_ids: torch.Tensor              # [B] int64, on the device
    logprobs: torch.Tensor | None        # [B, 2 + 2n] float64: chosen logprob, n, n top logprobs, n top ids


def sample_rows(logits: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, flags: StepFlags,
                bitmask: torch.Tensor | None = None, nucleus_kernel: bool = False,
                work: NucleusWork | None = None) -> SampleResult:
    """One token per row of logits [B, V] (any float dtype); `ints` [5, B] and `floats` [3, B] are the packed
    per-row parameters (see `Sampler`). No host sync, shapes fixed by (B, V, flags). `nucleus_kernel`: every
    sampled row by the Triton kernels (else by the torch draw, top-k candidates and the sort); `work`: their
    preallocated workspaces."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    key0, key1, position, top_k, path = ints
    temperature, top_p, min_p = floats
    logprobs = None
    if flags.top_logprobs is not None:
        lp = x.float().log_softmax(-1)  # the model's own distribution: before the mask and every filter
    if bitmask is not None:
        x = apply_token_bitmask(x.float(), bitmask)
    sampled = flags.paths - {GREEDY}
    if nucleus_kernel and sampled and GREEDY not in flags.paths:
        out = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)     # the kernels write every row
    else:
        out = x.argmax(-1)
    if sampled and nucleus_kernel:
        nucleus_draw(x, ints, temperature, top_p, min_p, tuple(sorted(sampled)), out,
                     top_k=bool(sampled & {TOP_K, SORTED}), work=work)
    elif sampled:
        x = x.float()
        V = x.shape[1]
        u = uniforms(key0, key1, position)
        x = x / temperature.unsqueeze(1)
        if PLAIN in flags.paths:
            m = x.amax(-1, keepdim=True)
            p = torch.exp(x - torch.where(torch.isfinite(m), m, 0.0))
            out = torch.where(path == PLAIN, draw(p, u), out)
        for here, k in (((TOP_K,), TOP_K_CAP), ((SORTED, NUCLEUS), V)):
            if flags.paths & set(here):
                vals, ids = canonical_candidates(x, k)
                pick = draw(keep_weights(vals, top_k, top_p, min_p), u)
                rows = (path == here[0]) | (path == here[-1])
                out = torch.where(rows, ids.gather(1, pick.unsqueeze(1)).squeeze(1), out)
    if flags.top_logprobs is not None:
        n = flags.top_logprobs
        chosen = lp.gather(1, out.unsqueeze(1))
        parts = [chosen.double(), torch.full_like(chosen, n, dtype=torch.float64)]
        if n:
            tv, ti = lp.topk(n, -1)
            parts += [tv.double(), ti.double()]
        logprobs = torch.cat(parts, 1)
    return SampleResult(out, logprobs)


def row_params(params: SamplingParams, seed: int, vocab_size: int) -> tuple[tuple, tuple]:
    """A request's packed parameters, built once when it is added: (key0, key1, top_k, path), (temperature,
    top_p, min_p). The position is filled per step."""
    k0, k1 = seed_keys(seed)
    if params.greedy:
        return (k0, k1, vocab_size, GREEDY), (1.0, 1.0, 0.0)
    has_top_k = 0 < params.top_k < vocab_size
    top_k = params.top_k if has_top_k else vocab_size
    if has_top_k:
        path = TOP_K if top_k <= TOP_K_CAP else SORTED
    elif params.top_p < 1 or params.min_p > 0:
        path = NUCLEUS
    else:
        path = PLAIN
    # above ~1e30 every finite logit divides to ~0 already (uniform); fp32 would overflow to inf
    return (k0, k1, top_k, path), (min(float(params.temperature), 1e30), float(params.top_p), float(params.min_p))


class Sampler:
    """Persistent per-row parameter buffers on the device and the batched draw over them."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, nucleus_kernel: bool | None = None):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        # sampled rows by the Triton kernels on CUDA (the CPU interpreter is far too slow to serve with)
        self.nucleus_kernel = self.device.type == "cuda" if nucleus_kernel is None else nucleus_kernel
        self.work = NucleusWork.allocate(max_rows, vocab_size, self.device, min_block=chunk_block(vocab_size)) \
            if self.nucleus_kernel else None
        R = max_rows
        self._nbytes = nbytes = 8 * _INTS * R + 4 * _FLOATS * R
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.ints, self.floats = self._views(self._dev)
        # on a GPU the rows are written into pinned buffers used in turn: with async scheduling the host prepares
        # step N+1 while step N's copy of its rows may not have run yet (PinnedStaging waits for a buffer's copy)
        self._staging = PinnedStaging(self.device, torch.uint8, nbytes) if self.device.type == "cuda" else None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        R, cut = self.max_rows, 8 * _INTS * self.max_rows
        return buf[:cut].view(torch.int64).view(_INTS, R), buf[cut:].view(torch.float32).view(_FLOATS, R)

    def row(self, params: SamplingParams, seed: int) -> tuple[tuple, tuple]:
        return row_params(params, seed, self.vocab_size)

    def prepare(self, rows: list[tuple[tuple, tuple]], positions: list[int],
                top_logprobs: int | None) -> StepFlags:
        """Write this step's rows (one `row()` per sampled request, and the position of the token it draws) with
        one host->device copy; return the step's flags."""
        B = len(rows)
        if B > self.max_rows:
            raise ValueError(f"{B} rows to sample, the sampler holds {self.max_rows}")
        ints = [(k0, k1, pos, k, path) for ((k0, k1, k, path), _), pos in zip(rows, positions)]
        host = self._dev if self._staging is None else self._staging.take(self._nbytes)
        host_ints, host_floats = self._views(host)
        host_ints[:, :B] = torch.tensor(ints, dtype=torch.int64).T
        host_floats[:, :B] = torch.tensor([f for _, f in rows], dtype=torch.float32).T
        if self._staging is not None:
            self._dev.copy_(host, non_blocking=True)
            self._staging.done()
        return StepFlags(frozenset(r[4] for r in ints), top_logprobs)

    def sample(self, logits: torch.Tensor, flags: StepFlags, bitmask: torch.Tensor | None = None) -> SampleResult:
        B = logits.shape[0]
        return sample_rows(logits, self.ints[:, :B], self.floats[:, :B], flags, bitmask, self.nucleus_kernel,
                           self.work)

    def warm_up_rows(self) -> list[list[SamplingParams]]:
        """The batches `warm_up` samples: one without a top-k row (the kernels' TOP_K = False variants), one with
        (TOP_K = True: the radix launches too); between them every path (greedy, plain temperature, top-p and
        min-p (nucleus), top-k, top-k + top-p, a top-k above TOP_K_CAP where the vocabulary has one) and a top-p
        so small that every rejection round refuses the row (the fallback runs)."""
        V = self.vocab_size
        plain, nucleus = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9)
        no_top_k = [SamplingParams(temperature=0.0), plain, nucleus, SamplingParams(temperature=1.0, min_p=0.1),
                    SamplingParams(temperature=1.0, top_p=1e-6)]
        k = max(1, min(TOP_K_CAP, V - 1) // 2)
        with_top_k = [SamplingParams(temperature=0.8, top_k=k), SamplingParams(temperature=0.8, top_k=k, top_p=0.9),
                      plain, nucleus]
        if TOP_K_CAP + 1 < V:
            with_top_k.append(SamplingParams(temperature=0.8, top_k=TOP_K_CAP + 1, top_p=0.9))
        return [no_top_k, with_top_k] if V > 1 else [no_top_k]

    def warm_up(self, dtype: torch.dtype = torch.float32) -> float:
        """Run the device kernels once per compiled variant (`warm_up_rows`) on scratch logits of `dtype` (the
        models' logits are fp32), so that serving compiles nothing: the paths a launch serves are a runtime
        argument of the kernels, so these variants are all there are for this vocabulary. Call it before serving
        (the engine does, before graph capture): it writes the per-row buffers, which the next `prepare` rewrites,
        and the workspaces, which the kernels leave as a call expects them. Returns its seconds; on the CPU, or
        with the torch paths, it does nothing (the interpreter compiles nothing)."""
        if not self.nucleus_kernel or self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        gen = torch.Generator(self.device).manual_seed(0)
        batches = [group[i:i + self.max_rows] for group in self.warm_up_rows()
                   for i in range(0, len(group), self.max_rows)]
        n = max(len(b) for b in batches)
        # nearly flat logits: the fallback's row refuses every rejection round
        logits = (torch.randn(n, self.vocab_size, generator=gen, device=self.device) * 0.1).to(dtype)
        for batch in batches:
            flags = self.prepare([self.row(p, 0) for p in batch], list(range(len(batch))), None)
            self.sample(logits[:len(batch)], flags)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info("sampler kernels warmed up in %.1f s (vocabulary %d, %d batches)", seconds, self.vocab_size,
                 len(batches))
        return seconds


def unpack_logprobs(packed: list[list[float]]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Host rows of `SampleResult.logprobs` -> (chosen logprob, [(token id, logprob)] * n) per row."""
    out = []
    for row in packed:
        n = int(row[1])
        out.append((row[0], [(int(i), v) for v, i in zip(row[2:2 + n], row[2 + n:2 + 2 * n])]))
    return out


# ---- the plain reference: the definition above, one row at a time ----------------------------------------------
def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row [V] is drawn from, written from the definition (for tests): float64, full sort."""
    x = logits.double()
    V = x.shape[0]
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), V).double()
    x = x / min(params.temperature, 1e30)
    order = sorted(range(V), key=lambda i: (-x[i].item(), i))
    p = torch.softmax(x, 0)[order]
    k = params.top_k if 0 < params.top_k < V else V
    p[k:] = 0
    q = p / p.sum()
    before = q.cumsum(0) - q
    keep = (before < params.top_p) & (p >= params.min_p * p[0])
    keep[0] = True
    p = p * keep
    out = torch.zeros(V, dtype=torch.float64)
    out[order] = p / p.sum()
    return out
