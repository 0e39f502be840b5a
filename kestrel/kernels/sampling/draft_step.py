"""One step of a drafter's token-by-token loop over the whole vocabulary, in three launches split across it.

Row r: logits x = base + bias (bias optional), temperature T (greedy below `greedy_below`: scale 1), s = x / scale,
q = softmax(s); the token is argmax x (lowest id on ties) on a greedy row, else the inverse-CDF draw with the row's
uniform u in [0, 1): the first token whose running sum of exp(s - max s) passes u times the row's total. `probs`
gets q, or the token's one-hot on a greedy row.

The torch form of this step (softmax, argmax, a two-level fp64 scan and searchsorted, a one-hot, a select: ~50
launches a step) ran one CTA per row in its softmax (41 us a row-step at K3's 163,840 ids on the H200, 2 us of
that the memory) and spent most of a DSpark propose's Markov loop in launch gaps. Here:
1. `_chunk_stats_kernel`, one program per (row, chunk of BLOCK ids): the chunk's max of s, its sum of exp(s - that
   max) and its argmax of x;
2. `_pick_kernel`, one program per row: the row's max M and total S from the chunks' (an online softmax's merge),
   the greedy token from the chunks' argmaxes, and for a sampled row the chunk whose running weight passes u * S
   (fp64, over the chunks), then the token inside it (one more read of that chunk, fp64 running sum); a draw that
   rounding puts past the chunk's sum takes the chunk's last token of positive weight (a zero weight is never
   drawn). Writes the token and (M, S);
3. `_probs_kernel`, one program per (row, chunk): q = exp(s - M) / S, or the one-hot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096              # ids per program of the split passes: 40 chunks a row at 163,840


@triton.jit
def _logits(base_ptr, bias_ptr, temp_ptr, row, offs, mask, base_stride, bias_stride,
            HAS_BIAS: tl.constexpr, GREEDY: tl.constexpr):
    """x and s = x / scale of one row's ids `offs` (-inf outside the vocabulary), and whether the row is greedy."""
    x = tl.load(base_ptr + row * base_stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + row * bias_stride + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t < GREEDY
    s = x / tl.where(greedy, 1.0, t)
    return x, s, greedy


@triton.jit
def _chunk_stats_kernel(base_ptr, bias_ptr, temp_ptr, smax_ptr, ssum_ptr, xmax_ptr, xarg_ptr,
                        V, NC, base_stride, bias_stride,
                        HAS_BIAS: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x, s, greedy = _logits(base_ptr, bias_ptr, temp_ptr, row, offs, mask, base_stride, bias_stride, HAS_BIAS, GREEDY)
    m = tl.max(s, 0)
    total = tl.sum(tl.where(mask, tl.exp(s - m), 0.0), 0)
    xm = tl.max(x, 0)
    arg = tl.min(tl.where(x == xm, offs, V), 0)          # the lowest id of the chunk's max
    tl.store(smax_ptr + row * NC + c, m)
    tl.store(ssum_ptr + row * NC + c, total)
    tl.store(xmax_ptr + row * NC + c, xm)
    tl.store(xarg_ptr + row * NC + c, arg)


@triton.jit
def _pick_kernel(base_ptr, bias_ptr, temp_ptr, u_ptr, smax_ptr, ssum_ptr, xmax_ptr, xarg_ptr, tok_ptr, norm_ptr,
                 V, NC, base_stride, bias_stride, tok_stride, u_stride,
                 HAS_BIAS: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr, NC_P2: tl.constexpr):
    row = tl.program_id(0)
    cs = tl.arange(0, NC_P2)
    cm = cs < NC
    m_c = tl.load(smax_ptr + row * NC + cs, mask=cm, other=float("-inf"))
    M = tl.max(m_c, 0)
    w = tl.where(cm, tl.load(ssum_ptr + row * NC + cs, mask=cm, other=0.0) * tl.exp(m_c - M), 0.0)
    S = tl.sum(w, 0)
    xm = tl.load(xmax_ptr + row * NC + cs, mask=cm, other=float("-inf"))
    arg = tl.load(xarg_ptr + row * NC + cs, mask=cm, other=V)
    tok_greedy = tl.min(tl.where(xm == tl.max(xm, 0), arg, V), 0)
    # the draw: the chunk whose running weight first passes u * S, then the id inside it
    target = tl.load(u_ptr + row * u_stride).to(tl.float64) * S.to(tl.float64)
    wcum = tl.cumsum(w.to(tl.float64), 0)
    c = tl.minimum(tl.sum((cm & (wcum <= target)).to(tl.int32), 0), NC - 1)
    before = tl.sum(tl.where(cs < c, w.to(tl.float64), 0.0), 0)
    ids = tl.arange(0, BLOCK)
    offs = c * BLOCK + ids
    mask = offs < V
    x, s, greedy = _logits(base_ptr, bias_ptr, temp_ptr, row, offs, mask, base_stride, bias_stride, HAS_BIAS, GREEDY)
    e = tl.where(mask, tl.exp(s - M), 0.0)
    icum = tl.cumsum(e.to(tl.float64), 0)
    j = tl.sum((mask & (icum <= target - before)).to(tl.int32), 0)
    last = tl.max(tl.where(e > 0, ids, -1), 0)
    j = tl.minimum(j, tl.maximum(last, 0))
    tok = tl.where(greedy, tok_greedy, c * BLOCK + j)
    tl.store(tok_ptr + row * tok_stride, tok.to(tl.int64))
    tl.store(norm_ptr + 2 * row, M)
    tl.store(norm_ptr + 2 * row + 1, S)


@triton.jit
def _probs_kernel(base_ptr, bias_ptr, temp_ptr, tok_ptr, norm_ptr, probs_ptr,
                  V, base_stride, bias_stride, tok_stride, probs_stride,
                  HAS_BIAS: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0), tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x, s, greedy = _logits(base_ptr, bias_ptr, temp_ptr, row, offs, mask, base_stride, bias_stride, HAS_BIAS, GREEDY)
    M = tl.load(norm_ptr + 2 * row)
    S = tl.load(norm_ptr + 2 * row + 1)
    tok = tl.load(tok_ptr + row * tok_stride)
    q = tl.where(greedy, (offs == tok).to(tl.float32), tl.exp(s - M) / S)
    tl.store(probs_ptr + row * probs_stride + offs, q, mask=mask)


def draft_step(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor, u: torch.Tensor,
               tokens: torch.Tensor, probs: torch.Tensor, greedy_below: float, block: int = BLOCK) -> None:
    """Writes tokens [R] (int64, any stride) and probs [R, V] (fp32, last dim contiguous) from base [R, V] and bias
    [R, V] or None (fp32, last dim contiguous, rows strided), temperature [R] fp32 (contiguous), u [R] fp64 (any
    stride); a row whose temperature is below `greedy_below` is greedy. No host sync; the only allocations are
    three small per-row scratch tensors (from the graph's pool under capture)."""
    R, V = base.shape
    if R == 0:
        return
    block = min(block, max(16, triton.next_power_of_2(V)))      # a small vocabulary (tests): one chunk
    nc = triton.cdiv(V, block)
    dev = base.device
    stats = torch.empty(3, R, nc, dtype=torch.float32, device=dev)
    xarg = torch.empty(R, nc, dtype=torch.int32, device=dev)
    norm = torch.empty(R, 2, dtype=torch.float32, device=dev)
    has_bias = bias is not None
    b = bias if has_bias else base
    rows = dict(HAS_BIAS=has_bias, GREEDY=greedy_below, BLOCK=block, num_warps=8)
    _chunk_stats_kernel[(R, nc)](base, b, temperature, stats[0], stats[1], stats[2], xarg, V, nc, base.stride(0),
                                 b.stride(0), **rows)
    _pick_kernel[(R,)](base, b, temperature, u, stats[0], stats[1], stats[2], xarg, tokens, norm, V, nc,
                       base.stride(0), b.stride(0), tokens.stride(0), u.stride(0),
                       NC_P2=triton.next_power_of_2(nc), **rows)
    _probs_kernel[(R, nc)](base, b, temperature, tokens, norm, probs, V, base.stride(0), b.stride(0),
                           tokens.stride(0), probs.stride(0), **rows)
