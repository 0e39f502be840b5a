"""KDA decode in one launch: one token per request, from the projected rows to the gated-norm output.

Per request b (state slot s = slots[b]) and head h, with W = H*D and channels c of the fused q|k|v row:
    conv:  x_c = silu(sum_{j<K-1} w[c, j] conv_state[s, c, j] + w[c, K-1] mixed[b, c]);
           conv_state[s, c, :] <- (conv_state[s, c, 1:], mixed[b, c])
    q, k, v = x over the channels h*D.., W + h*D.., 2W + h*D..  (fp32, never rounded)
    q <- q / sqrt(sum(q^2) + 1e-6) * D^-0.5 ;  k <- k / sqrt(sum(k^2) + 1e-6)
    g = -exp(A_log[h]) * softplus(f + dt_bias)            (Kimi Linear, lower_bound None)
      = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))        (K3, lower_bound lb < 0);   beta = sigmoid(b[b, h])
    S = rec_state[s, h] ([D_k, D_v] fp32):  S <- S * exp(g)[:, None];  S <- S + k (beta (v - S^T k))^T;  o = S^T q
    y[b, h*D:(h+1)*D] = norm_w * o * rsqrt(mean(o^2) + eps) * sigmoid(gate[b, h*D..])

One program per (request, head): the per-head norm needs every v column of o, and the q / k conv state is read by
every column, so splitting the head over programs would race on the conv state and leave the norm without its row.
The program streams the head's [D, D] state in blocks of BV value columns (each column's update depends only on q,
k, the decay, beta and its own v): the block loads, decays, is updated and stored, with the next block's load
already issued, and o of the block is S_decayed^T q + u (k . q) (= S_new^T q, so one reduction pass over the
block gives both S^T k and S^T q). o stays in registers ([D] values) for the norm at the end. Holding the whole
state took 156 registers a thread and one program an SM; a [D, BV] block keeps several programs on each SM, so
the state streams at the copy bandwidth. Rows whose slot equals `pad_slot` (CUDA-graph padding: they all point
at one scratch slot) write zeros to y and leave every state untouched, so repeated padding never races. The grid
is (B, H), from static shapes; no host value is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.kda._common import _sum_combine
from kestrel.kernels.kda.gate import _softplus


@triton.jit
def _conv_channels(m_row, w_ptr, cs_base, c, j, stride_cs_c, KW: tl.constexpr):
    """silu(conv) of channels c for one token, and the shifted state to store (the caller stores it once every
    thread of the program has read the old one)."""
    jm = j < KW - 1
    x = tl.load(m_row + c).to(tl.float32)
    st_ptrs = cs_base + c[:, None] * stride_cs_c + j[None, :]
    st = tl.load(st_ptrs, mask=jm[None, :], other=0.0)
    nxt = tl.load(st_ptrs + 1, mask=(j < KW - 2)[None, :], other=0.0)
    w_hist = tl.load(w_ptr + c[:, None] * KW + j[None, :], mask=jm[None, :], other=0.0).to(tl.float32)
    w_cur = tl.load(w_ptr + c * KW + (KW - 1)).to(tl.float32)
    y = tl.reduce(st.to(tl.float32) * w_hist, 1, _sum_combine) + x * w_cur
    y = y / (1.0 + tl.exp(-tl.maximum(y, -88.0)))                   # silu; the clamp keeps exp finite
    new = tl.where((j == KW - 2)[None, :], x[:, None].to(st.dtype), nxt)
    return y, new, st_ptrs


# pad_slot is one value for the engine's life, but let no value of it (e.g. its divisibility by 16) pick a new
# specialization: a decode step must never compile on the serving path
@triton.jit(do_not_specialize=["pad_slot"])
def _kda_decode_kernel(
    m_ptr, f_ptr, b_ptr, gate_ptr, cw_ptr, cs_ptr, rs_ptr, slots_ptr, a_log_ptr, dt_ptr, nw_ptr, y_ptr,
    stride_m, stride_f, stride_b, stride_gate, stride_y, stride_cs_slot, stride_cs_c, stride_rs_slot,
    pad_slot, scale, eps, lower_bound,
    H: tl.constexpr, D: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr, USE_LB: tl.constexpr,
    BV: tl.constexpr, PREFETCH: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    W = H * D
    NB: tl.constexpr = D // BV
    slot = tl.load(slots_ptr + b)
    d = tl.arange(0, D)
    keep = (tl.zeros([D], dtype=tl.int32) + slot) != pad_slot      # [D]: not a padding row
    nb = tl.arange(0, NB)
    cv = tl.arange(0, BV)
    live = (tl.zeros([1, BV], dtype=tl.int32) + slot) != pad_slot    # the same, broadcast over a state block
    slot = slot.to(tl.int64)
    # S[:, block i] of the fp32 state slot is s_blk + i * BV; its first block is on the way during the conv
    s_blk = rs_ptr + slot * stride_rs_slot + h * D * D + d[:, None] * D + cv[None, :]
    s_next = tl.load(s_blk)

    j = tl.arange(0, KP)
    m_row = m_ptr + b * stride_m
    cs_base = cs_ptr + slot * stride_cs_slot
    q, q_new, q_ptrs = _conv_channels(m_row, cw_ptr, cs_base, h * D + d, j, stride_cs_c, KW)
    k, k_new, k_ptrs = _conv_channels(m_row, cw_ptr, cs_base, W + h * D + d, j, stride_cs_c, KW)
    v, v_new, v_ptrs = _conv_channels(m_row, cw_ptr, cs_base, 2 * W + h * D + d, j, stride_cs_c, KW)
    # every thread has read the old conv columns before any thread of this program rewrites them; the three
    # sections' loads are in flight together (one barrier, not one a section)
    tl.debug_barrier()
    cs_keep = keep[:, None] & (j < KW - 1)[None, :]
    tl.store(q_ptrs, q_new, mask=cs_keep)
    tl.store(k_ptrs, k_new, mask=cs_keep)
    tl.store(v_ptrs, v_new, mask=cs_keep)
    q = q * (scale / tl.sqrt(tl.reduce(q * q, 0, _sum_combine) + 1e-6))
    k = k / tl.sqrt(tl.reduce(k * k, 0, _sum_combine) + 1e-6)
    kq = tl.reduce(k * q, 0, _sum_combine)
    v2 = tl.reshape(v, [NB, BV])                                      # v2[i, :] = v[block i]

    # gates: per-channel log decay and beta
    x = tl.load(f_ptr + b * stride_f + h * D + d).to(tl.float32) + tl.load(dt_ptr + h * D + d).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    if USE_LB:
        g = lower_bound / (1.0 + tl.exp(-tl.maximum(a * x, -88.0)))
    else:
        g = -a * _softplus(x)
    decay = tl.exp(g)
    beta = 1.0 / (1.0 + tl.exp(-tl.maximum(tl.load(b_ptr + b * stride_b + h).to(tl.float32), -88.0)))

    # the delta-rule step, streamed over blocks of BV value columns (each column of S is independent given q, k
    # and the decay): a [D, BV] block in registers, the next block's load issued before this one's math and store
    o2 = tl.zeros([NB, BV], dtype=tl.float32)                        # o2[i, :] = o[block i]
    for i in range(NB):
        if PREFETCH:
            S = s_next
            s_next = tl.load(s_blk + (i + 1) * BV, mask=(cv[None, :] * 0 + i + 1) < NB, other=0.0)
        else:
            S = tl.load(s_blk + i * BV)
        S = S * decay[:, None]
        v_i = tl.reduce(tl.where(nb[:, None] == i, v2, 0.0), 0, _sum_combine)
        sk, sq = tl.split(tl.reduce(tl.join(S * k[:, None], S * q[:, None]), 0, _sum_combine))
        u = beta * (v_i - sk)
        o_i = sq + u * kq
        S = S + k[:, None] * u[None, :]
        tl.store(s_blk + i * BV, S, mask=live)
        o2 = tl.where(nb[:, None] == i, o_i[None, :], o2)

    # gated per-head RMSNorm over the whole o row
    inv = 1.0 / tl.sqrt(tl.reduce(tl.reduce(o2 * o2, 1, _sum_combine), 0, _sum_combine) / D + eps)
    col = h * D + nb[:, None] * BV + cv[None, :]
    gt = tl.load(gate_ptr + b * stride_gate + col).to(tl.float32)
    y = tl.load(nw_ptr + col - h * D).to(tl.float32) * o2 * inv / (1.0 + tl.exp(-tl.maximum(gt, -88.0)))
    y = tl.where(live, y, 0.0)
    tl.store(y_ptr + b * stride_y + col, y.to(y_ptr.dtype.element_ty))


def launch_config(D: int) -> dict:
    """The kernel's block and launch knobs for head dim D (one config per width: the batch never picks a variant,
    so no batch size compiles a new one on the serving path). At D = 128: [128, 32] fp32 blocks (16 KB) over 4
    warps, one in flight while the previous one is updated, so several programs share an SM and the state
    streams (the whole-state program needed 156 registers a thread and held an SM alone). Small D (the CPU cells)
    still splits the head into two blocks so that the block loop is exercised."""
    bv = 32 if D >= 64 else D // 2
    return dict(block_v=bv, num_warps=4, prefetch=True)


def kda_decode(mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_weight: torch.Tensor,
               conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, lower_bound: float | None = None,
               pad_slot: int = -1, out: torch.Tensor | None = None, config: dict | None = None):
    """mixed [B, 3W], f [B, W], b [B, H], gate [B, W] (unit stride along the last dim, any row stride);
    conv_weight [3W, K] contiguous; conv_state [S, 3W, K-1] (unit stride along K-1); rec_state [S, H, D, D] fp32
    contiguous; slots int32 [B]; A_log [H], dt_bias [W], norm_weight [D]. Returns (y [B, W] in gate's dtype,
    conv_state, rec_state), the states updated in place. `config` overrides `launch_config(D)` (benchmarks only)."""
    B = slots.shape[0]
    H = A_log.numel()
    D = norm_weight.numel()
    KW = conv_weight.shape[1]
    cfg = config or launch_config(D)
    if out is None:
        out = torch.empty((B, H * D), dtype=gate.dtype, device=gate.device)
    if B > 0:
        _kda_decode_kernel[(B, H)](
            mixed, f, b, gate, conv_weight, conv_state, rec_state, slots, A_log, dt_bias, norm_weight, out,
            mixed.stride(0), f.stride(0), b.stride(0), gate.stride(0), out.stride(0),
            conv_state.stride(0), conv_state.stride(1), rec_state.stride(0),
            int(pad_slot), D ** -0.5, float(eps), float(lower_bound) if lower_bound is not None else 0.0,
            H=H, D=D, KW=KW, KP=triton.next_power_of_2(max(KW - 1, 2)), USE_LB=lower_bound is not None,
            BV=cfg["block_v"], PREFETCH=cfg["prefetch"], num_warps=cfg["num_warps"],
        )
    return out, conv_state, rec_state
