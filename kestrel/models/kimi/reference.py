"""The reference implementation of Kimi Linear and Kimi K3: plain torch, any device, any dtype.

This file is the executable spec every fast path is checked against, so it favours the obvious formulation over a
fast one. It runs one *step*: a flat batch of tokens from several requests (prefill chunks and decode tokens mixed),
reading and writing the runtime's cache pools (paged MLA latents, KDA state slots). Parameter names follow
Moonshot's checkpoint layout (see weights.py for the other spellings), with routed experts stacked per layer as
`w13` [E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I].

Numerics: norms, router, softmax, activations, KDA gates and recurrence in fp32; matmuls in the model dtype. The
maths of those ops is written once, in `kestrel/ops/`, and called from here and from the catalog entries'
`reference`, so the model and the kernels' certification share one spec.

Several ranks (`mapping`, kestrel/parallel/mapping.py): each module is built with this rank's part of its weights
(heads, channels, experts; the rules are in kestrel/parallel/shard.py) and calls the collectives of
kestrel/parallel/comm.py where its layout needs them: o_proj and down_proj outputs are all-reduced (row-parallel),
routed experts' partial sums too; DEP gathers every rank's tokens for the experts and keeps its own rows of the
reduced result; Helix MLA attends over the rank's share of the sequence and merges the heads' partial outputs by
their log-sum-exp. One rank (no mapping) calls none of them.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import KDA, ModelConfig
from kestrel.models.kimi.step import CachePools, StepBatch
from kestrel.parallel import comm
from kestrel.parallel.mapping import Mapping
from kestrel.ops import attention as attention_ops
from kestrel.ops import kda as kda_ops
from kestrel.ops import moe as moe_ops
from kestrel.ops import norm as norm_ops
from kestrel.quant.kv_cache import KvPageFormat

MLA_LOWRANK_NORM_EPS = 1e-6   # q_a_layernorm / kv_a_layernorm: Moonshot builds them with the default eps


# ---------------------------------------------------------------------------------------------------------------
# small functions shared by several modules

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, rounded once to x's dtype."""
    return norm_ops.rms_norm(x, weight, eps).to(x.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """SiLU-GLU (Kimi Linear) or SiTU-GLU (K3: 4*tanh(g/4)*sigmoid(g) * 25*tanh(u/25) with the config's betas)."""
    return moe_ops.glu(gate, up, config.hidden_act, config.situ_beta, config.situ_linear_beta)


def weight(p, index: int | None = None) -> torch.Tensor:
    """Where the math reads a linear weight (`index`: one expert of a stacked weight). A quantized checkpoint's
    weights are `kestrel.quant.QuantizedWeight`s and dequantize here, on the fly, to the model dtype."""
    if isinstance(p, torch.Tensor):
        return p if index is None else p[index]
    return p.dequantize(index)


class _PerExpert:
    """A stacked expert weight indexed through `weight()`: `[e]` is expert e's matrix, dequantized if need be."""

    def __init__(self, p):
        self.p = p

    def __getitem__(self, e: int) -> torch.Tensor:
        return weight(self.p, e)


class _Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight(self.weight))


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return _Linear(n_in, n_out, bias=False)


# ---------------------------------------------------------------------------------------------------------------
# MLP and MoE

class DenseMLP(nn.Module):
    """SiLU / SiTU GLU MLP. `parts` > 1: this rank's share of the channels (column- then row-parallel); forward
    then returns a partial sum, which the caller all-reduces (`reduce=True`: here)."""

    def __init__(self, config: ModelConfig, hidden: int, inter: int, parts: int = 1):
        super().__init__()
        self.config, self.parts = config, parts
        inter //= parts
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        y = self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.config))
        return comm.all_reduce(y) if reduce and self.parts > 1 else y


class Router(nn.Module):
    """Sigmoid scores; top-k chosen by score + correction bias (optionally within the best groups); weights are the
    unbiased scores of the chosen experts, renormalized, times routed_scaling_factor."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        ids, weights, _ = moe_ops.route(x, self.weight, self.e_score_correction_bias, c.num_experts_per_tok,
                                        c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        return ids, weights


class MoE(nn.Module):
    """Routed experts (stacked) plus shared experts. K3's latent MoE runs the routed experts on
    z = routed_expert_down_proj(x), normalizes their weighted sum and projects it back up; shared experts see x.
    Several ranks: this rank's experts (`mapping.experts`) and its share of each one's channels; their partial
    weighted sum is all-reduced (before K3's norm, which needs the whole sum). DEP: the experts run on every
    rank's tokens (gathered), and each rank keeps its own rows; shared experts stay on the rank's own tokens."""

    def __init__(self, config: ModelConfig, mapping: Mapping | None = None):
        super().__init__()
        c = self.config = config
        self.mapping = m = mapping or Mapping()
        width = c.routed_expert_hidden_size or c.hidden_size
        self.gate = Router(config)
        self.experts = nn.Module()
        n_local, inter = c.num_experts // m.ep, c.moe_intermediate_size // m.moe_tp
        self.expert0 = m.experts(c.num_experts).start
        self.experts.w13 = nn.Parameter(torch.empty(n_local, 2 * inter, width))
        self.experts.w2 = nn.Parameter(torch.empty(n_local, width, inter))
        if c.n_shared_experts:
            self.shared_experts = DenseMLP(config, c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, m.tp)
        if c.routed_expert_hidden_size:
            self.routed_expert_down_proj = _linear(c.hidden_size, width)
            self.routed_expert_up_proj = _linear(width, c.hidden_size)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = nn.Parameter(torch.ones(width))

    def routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self.mapping.moe_parallel:
            # this rank's experts only: the others' (id < 0) are skipped; the sum over ranks is all-reduced, in
            # fp32, before it is rounded to the model dtype (as one rank rounds its whole sum once)
            local = ids - self.expert0
            ids = torch.where((local >= 0) & (local < self.experts.w13.shape[0]), local, -1)
            y = moe_ops.experts(z, _PerExpert(self.experts.w13), _PerExpert(self.experts.w2), ids, weights,
                                c.hidden_act, c.situ_beta, c.situ_linear_beta)
            return comm.all_reduce(y).to(z.dtype)
        return moe_ops.experts(z, _PerExpert(self.experts.w13), _PerExpert(self.experts.w2), ids, weights,
                               c.hidden_act, c.situ_beta, c.situ_linear_beta).to(z.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own = x
        if self.mapping.dispatch:             # DEP: dispatch every rank's tokens to the experts (all-gather)
            x, counts = comm.all_gather_rows(x)
        ids, weights = self.gate(x)
        if self.config.routed_expert_hidden_size:
            y = self.routed(self.routed_expert_down_proj(x), ids, weights)
            if self.config.latent_moe_use_norm:
                y = rms_norm(y, self.routed_expert_norm, self.config.rms_norm_eps)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x, ids, weights)
        if self.mapping.dispatch:             # combine: the reduced sum is on every rank; keep this rank's rows
            start = sum(counts[:self.mapping.rank])
            y = y[start:start + own.shape[0]]
        if self.config.n_shared_experts:
            y = y + self.shared_experts(own)
        return y


# ---------------------------------------------------------------------------------------------------------------
# KDA: Kimi delta attention

class KdaAttention(nn.Module):
    """Several ranks (tp, helix): this rank's heads; o_proj is row-parallel and its output all-reduced."""

    def __init__(self, config: ModelConfig, mapping: Mapping | None = None):
        super().__init__()
        c = self.config = config
        self.parts = (mapping or Mapping()).tp
        self.H = H = c.kda_num_heads // self.parts
        D, K = c.kda_head_dim, c.conv_kernel_size
        self.W = W = H * D
        self.q_proj, self.k_proj, self.v_proj = _linear(c.hidden_size, W), _linear(c.hidden_size, W), _linear(c.hidden_size, W)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (nn.Parameter(torch.empty(W, 1, K)) for _ in range(3))
        self.f_a_proj, self.f_b_proj = _linear(c.hidden_size, D), _linear(D, W)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(W, dtype=torch.float32))
        self.b_proj = _linear(c.hidden_size, H)
        if c.kda_full_rank_output_gate:
            self.g_proj = _linear(c.hidden_size, W)
        else:
            self.g_a_proj, self.g_b_proj = _linear(c.hidden_size, D), _linear(D, W)
        self.o_norm = nn.Parameter(torch.ones(D))
        self.o_proj = _linear(W, c.hidden_size)
        self.replay: dict[int, tuple[torch.Tensor, ...]] = {}

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel log decay g [T, H, D] (fp32, <= 0) and beta [T, H] (fp32)."""
        return kda_ops.gates(self.f_b_proj(self.f_a_proj(x)), self.A_log, self.dt_bias, self.b_proj(x),
                             self.config.gate_lower_bound)

    def conv_weight(self) -> torch.Tensor:
        return torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d]).squeeze(1)   # [C, K]

    def short_conv(self, mixed: torch.Tensor, conv_state: torch.Tensor, rows: slice | torch.Tensor,
                   slots: torch.Tensor, update: bool = True) -> torch.Tensor:
        """Causal depthwise conv (width K) + SiLU over the tokens `rows` of len(slots) requests that each bring
        the same number of tokens, continuing from (and, if `update`, updating) their conv states."""
        x = mixed[rows].view(len(slots), -1, mixed.shape[-1])                          # [B, L, C]
        y, new = kda_ops.short_conv(x, self.conv_weight(), conv_state[slots])
        if update:
            conv_state[slots] = new
        return y.to(mixed.dtype).view(-1, mixed.shape[-1])

    def forward(self, x: torch.Tensor, batch: StepBatch, conv_state: torch.Tensor, rec_state: torch.Tensor):
        c = self.config
        H, D = self.H, c.kda_head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g, beta = self.gates(x)
        o = torch.empty(x.shape[0], H, D, dtype=torch.float32, device=x.device)
        snapshot_after = dict(batch.snapshots)
        verify = set(batch.verify_segments)
        # the replay buffer: per verify segment, the block's conv inputs and its post-conv q / k / v, g, beta
        self.replay: dict[int, tuple[torch.Tensor, ...]] = {}
        for rows, slots, b in _segment_groups(batch, snapshot_after, x.device, verify):
            B = len(slots)
            q, k, v = self.short_conv(mixed, conv_state, rows, slots, update=b not in verify).split(self.W, dim=-1)
            q, k, v = (t.reshape(B, -1, H, D) for t in (q, k, v))
            gb, bb = g[rows].view(B, -1, H, D), beta[rows].view(B, -1, H)
            out, final = kda_ops.recurrence(q, k, v, gb, bb, rec_state[slots])
            o[rows] = out.reshape(-1, H, D)
            if b in verify:          # the state stays as it was before the block until commit_verify
                self.replay[b] = (mixed[rows], q[0], k[0], v[0], gb[0], bb[0])
                continue
            rec_state[slots] = final.to(rec_state.dtype)      # fp32 math; the pool may keep bf16 (--kda-state-dtype)
            if b in snapshot_after:
                conv_state[snapshot_after[b]] = conv_state[slots[0]]
                rec_state[snapshot_after[b]] = rec_state[slots[0]]
        gate = self.g_proj(x) if c.kda_full_rank_output_gate else self.g_b_proj(self.g_a_proj(x))
        o = norm_ops.gated_rms_norm(o, gate.view(-1, H, D), self.o_norm, c.rms_norm_eps)
        y = self.o_proj(o.to(x.dtype).reshape(x.shape[0], -1))
        return comm.all_reduce(y) if self.parts > 1 else y

    def commit_verify(self, accepted: dict[int, int], slots: dict[int, int], conv_state: torch.Tensor,
                      rec_state: torch.Tensor) -> None:
        """Advance each verify segment's state over its first `accepted[b]` tokens only, from the state the block
        started from (still in slot `slots[b]`), replaying the inputs the forward kept."""
        for b, n in accepted.items():
            if n == 0:               # a padding block of a padded verify step: its (scratch) state stays
                continue
            mixed, q, k, v, g, beta = self.replay[b]
            s = slots[b]
            _, conv_state[s:s + 1] = kda_ops.short_conv(mixed[None, :n], self.conv_weight(), conv_state[s:s + 1])
            _, rec_state[s:s + 1] = kda_ops.recurrence(q[None, :n], k[None, :n], v[None, :n], g[None, :n],
                                                       beta[None, :n], rec_state[s:s + 1])
        self.replay = {}


def _segment_groups(batch: StepBatch, snapshot_after: dict[int, int], device: torch.device, verify=()):
    """(rows, slots, segment) groups for the KDA state updates, in an order that keeps each request's segments in
    sequence: single-token segments of requests with no other segment together (decode is where a server spends
    its steps), then every other segment (verify blocks included) alone, in batch order."""
    slots = batch.slot_list
    # a request cut into several segments (prompt chunk split at snapshot boundaries) must run them in order
    counts = Counter(slots)
    single = [b for b in range(batch.num_reqs)
              if batch.seq_len(b) == 1 and b not in snapshot_after and b not in verify and counts[slots[b]] == 1]
    if single:
        rows = torch.tensor([batch.cu_seqlens[b] for b in single], device=device)
        yield rows, batch.slots[single], None
    for b in range(batch.num_reqs):
        if b not in single:
            yield slice(batch.cu_seqlens[b], batch.cu_seqlens[b + 1]), batch.slots[b:b + 1], b


# ---------------------------------------------------------------------------------------------------------------
# MLA: multi-head latent attention, NoPE, over the paged latent cache

class MlaAttention(nn.Module):
    """Several ranks. tp: this rank's heads (queries, up-projections, gate, o_proj rows), o_proj all-reduced.
    Helix: every rank computes all heads' queries over its share of the cached tokens (token t on rank t mod N,
    slot (t mod page_size) / N of its page), the partial outputs and log-sum-exps go all-to-all over heads, each
    rank merges its heads exactly and applies its part of the gate and o_proj (all-reduced)."""

    def __init__(self, config: ModelConfig, mapping: Mapping | None = None):
        super().__init__()
        c = self.config = config
        m = mapping or Mapping()
        self.parts, self.helix, self.rank = m.tp, m.helix, m.tp_rank
        self.H = H = c.num_heads if m.helix > 1 else c.num_heads // m.tp     # heads whose queries this rank has
        H_out = c.num_heads // m.tp                                          # heads whose output it projects
        self.lowrank_eps = MLA_LOWRANK_NORM_EPS     # a DSpark draft layer uses its config's rms_norm_eps here
        if c.q_lora_rank:
            self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank)
            self.q_a_layernorm = nn.Parameter(torch.ones(c.q_lora_rank))
            self.q_b_proj = _linear(c.q_lora_rank, H * c.qk_head_dim)
        else:
            self.q_proj = _linear(c.hidden_size, H * c.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = nn.Parameter(torch.ones(c.kv_lora_rank))
        self.kv_b_proj = _linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim))
        if c.mla_use_output_gate:
            self.g_proj = _linear(c.hidden_size, H_out * c.v_head_dim)
        self.o_proj = _linear(H_out * c.v_head_dim, c.hidden_size)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.q_lora_rank:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_layernorm, self.lowrank_eps))
        else:
            q = self.q_proj(x)
        return q.view(-1, self.H, c.qk_head_dim)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token cache entry: [normalized c_kv (kv_lora_rank) | k_pe (rope dim, never rotated: NoPE)]."""
        c = self.config
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return torch.cat([rms_norm(ckv, self.kv_a_layernorm, self.lowrank_eps), k_pe], dim=-1)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, nope, L] and W_UV [H, v, L]."""
        c = self.config
        w = weight(self.kv_b_proj.weight).view(self.H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def attend_expanded(self, q: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor,
                        visible: torch.Tensor | None = None):
        """Prefill form: expand the context latents to per-head keys and values. q [L, H, Dqk], ctx [S, W];
        `visible` [L, S] (default: the causal mask of ctx in position order). Given `visible` (Helix), returns the
        fp32 output and its log-sum-exp [L, H] instead."""
        c = self.config
        L_ = c.kv_lora_rank
        kv = self.kv_b_proj(ctx[:, :L_]).view(-1, self.H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = ctx[:, L_:].unsqueeze(1).expand(-1, self.H, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        partial = visible is not None
        if not partial:
            visible = torch.arange(ctx.shape[0], device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)   # [L, S]
        o, lse = attention_ops.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), c.softmax_scale,
                                         visible)                                                 # [H, L, v]
        return (o.transpose(0, 1), lse.transpose(0, 1)) if partial else o.transpose(0, 1).to(q.dtype)

    def attend_absorbed(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor, with_lse: bool = False):
        """Decode form: fold W_UK into the query and W_UV into the output, so attention runs over one latent head
        of width kv_lora + rope. q [B, H, Dqk] or [B, L, H, Dqk] (L queries that all see the same keys, e.g. a
        drafter's block), ctx [B, S, W], mask [B, S] (True = visible); the output has q's leading shape.
        `with_lse` (Helix): returns the fp32 output and its log-sum-exp (q's leading shape) instead."""
        c = self.config
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = q.float().split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_abs = torch.cat([torch.einsum("...hn,hnl->...hl", q_nope, w_uk.float()), q_pe], dim=-1)   # [.., H, W]
        B, W = q.shape[0], q_abs.shape[-1]
        o_lat, lse = attention_ops.attention(q_abs.reshape(B, -1, W), ctx, ctx[..., :c.kv_lora_rank],
                                             c.softmax_scale, mask.unsqueeze(1))
        o_lat = o_lat.view(*q.shape[:-1], c.kv_lora_rank)
        o = torch.einsum("...hl,hvl->...hv", o_lat, w_uv.float())
        return (o, lse.view(*q.shape[:-1])) if with_lse else o.to(q.dtype)

    def helix_attention(self, q: torch.Tensor, latents: torch.Tensor, batch: StepBatch,
                        pages: torch.Tensor) -> torch.Tensor:
        """Helix: attention of all heads over this rank's share of each request's tokens, then one all-to-all over
        heads of the partial outputs and log-sum-exps, merged exactly. Returns this rank's heads [T, H/N, v]."""
        c = self.config
        write_latents(pages, batch, latents, shards=self.helix, rank=self.rank)
        T = q.shape[0]
        o = torch.zeros(T, self.H, c.v_head_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((T, self.H), float("-inf"), dtype=torch.float32, device=q.device)
        for b in range(batch.num_reqs):
            s, e = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            ctx, pos = read_latents(pages, batch, b, batch.context_lens[b] + (e - s),
                                    shards=self.helix, rank=self.rank)
            visible = pos.unsqueeze(0) <= batch.positions[s:e].unsqueeze(1)                       # [L, S_local]
            if e - s == 1:
                ob, lb = self.attend_absorbed(q[s:e], ctx.unsqueeze(0), visible, with_lse=True)
            else:
                ob, lb = self.attend_expanded(q[s:e], ctx, batch.positions[s:e], visible)
            o[s:e], lse[s:e] = ob, lb
        return attention_ops.merge_attention_partials(comm.all_to_all_heads(o), comm.all_to_all_heads(lse))

    def forward(self, x: torch.Tensor, batch: StepBatch, pages: torch.Tensor,
                fmt: KvPageFormat | None = None) -> torch.Tensor:
        """`fmt`: how the pages store a latent (quantized FP8 / NVFP4 rows are written through its encode and read
        back through its decode, in the model dtype); None = plain rows of the pages' dtype."""
        c = self.config
        q = self.query(x)
        if self.helix > 1:
            return self.output(self.helix_attention(q, self.latent(x), batch, pages).to(x.dtype), x)
        write_latents(pages, batch, self.latent(x), fmt)
        o = torch.empty(x.shape[0], self.H, c.v_head_dim, dtype=x.dtype, device=x.device)
        decode = [b for b in range(batch.num_reqs) if batch.seq_len(b) == 1]
        if decode:
            # single-token segments are batched together: that is where a server spends its steps
            rows = torch.tensor([batch.cu_seqlens[b] for b in decode], device=x.device)
            lens = [batch.context_lens[b] + 1 for b in decode]
            ctx = torch.stack([_pad(read_latents(pages, batch, b, n, fmt, x.dtype), max(lens))
                               for b, n in zip(decode, lens)])
            mask = torch.arange(max(lens), device=x.device).unsqueeze(0) < torch.tensor(lens, device=x.device).unsqueeze(1)
            o[rows] = self.attend_absorbed(q[rows], ctx, mask)
        for b in range(batch.num_reqs):
            if batch.seq_len(b) == 1:
                continue
            s, e = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            ctx = read_latents(pages, batch, b, batch.context_lens[b] + (e - s), fmt, x.dtype)
            o[s:e] = self.attend_expanded(q[s:e], ctx, batch.positions[s:e])
        return self.output(o, x)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output gate (K3) and o_proj of this rank's heads o [T, H_out, v]; row-parallel: all-reduced."""
        if self.config.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float()).view_as(o).to(o.dtype)
        y = self.o_proj(o.reshape(x.shape[0], -1))
        return comm.all_reduce(y) if self.parts > 1 else y


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, n - t.shape[0]))


def write_latents(pages: torch.Tensor, batch: StepBatch, latents: torch.Tensor,
                  fmt: KvPageFormat | None = None, shards: int = 1, rank: int = 0) -> None:
    """Store each token's latent at its position in its request's pages (quantized first when `fmt` says so).
    Helix (`shards` ranks, plain rows): this rank keeps the tokens t with t mod shards == rank, at slot
    (t mod page_size) / shards of a page `page_size / shards` long."""
    page_size = pages.shape[1] * shards
    req = torch.repeat_interleave(torch.arange(batch.num_reqs, device=latents.device),
                                  torch.tensor([batch.seq_len(b) for b in range(batch.num_reqs)], device=latents.device))
    pos = batch.positions
    if shards > 1:
        mine = pos % shards == rank
        req, pos, latents = req[mine], pos[mine], latents[mine]
    page = batch.block_tables[req, pos // page_size].long()
    if fmt is not None:
        L = fmt.kv_lora_rank
        latents = fmt.encode(latents[:, :L], latents[:, L:])
    pages[page, (pos % page_size) // shards] = latents.to(pages.dtype)


def read_latents(pages: torch.Tensor, batch: StepBatch, b: int, n: int, fmt: KvPageFormat | None = None,
                 dtype: torch.dtype | None = None, shards: int = 1, rank: int = 0):
    """The first n cached latents of request b, in position order: [n, L + R] (dequantized when `fmt` is quantized;
    in `dtype` when given, else the pages' own). Helix (`shards` ranks, plain rows): the ones this rank holds and
    their positions ([n_local, W], [n_local])."""
    if shards == 1:
        rows = read_row(pages, batch.block_tables[b], n)
        if fmt is not None:
            return fmt.decode(rows, dtype or torch.float32)
        return rows if dtype is None else rows.to(dtype)
    local = pages.shape[1]
    page_size = local * shards
    n_pages = -(-n // page_size)
    ctx = pages[batch.block_tables[b, :n_pages].long()].reshape(-1, pages.shape[-1])
    k = torch.arange(ctx.shape[0], device=ctx.device)
    pos = (k // local) * page_size + (k % local) * shards + rank
    keep = pos < n
    return ctx[keep], pos[keep]


def read_row(pages: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of the block-table row `row` (one request's pages), in position order: [n, page width]."""
    n_pages = -(-n // pages.shape[1])
    return pages[row[:n_pages].long()].reshape(-1, pages.shape[-1])[:n]


# ---------------------------------------------------------------------------------------------------------------
# the model

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, i: int, mapping: Mapping | None = None):
        super().__init__()
        self.index, self.kind = i, config.layer_kinds[i]
        self.self_attn = KdaAttention(config, mapping) if self.kind == KDA else MlaAttention(config, mapping)
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        if config.is_moe_layer(i):
            self.block_sparse_moe = MoE(config, mapping)
        else:
            self.mlp = DenseMLP(config, config.hidden_size, config.intermediate_size, (mapping or Mapping()).tp)
        if config.attn_res_block_size:
            self.self_attention_res_proj = nn.Parameter(torch.empty(1, config.hidden_size))
            self.self_attention_res_norm = nn.Parameter(torch.ones(config.hidden_size))
            self.mlp_res_proj = nn.Parameter(torch.empty(1, config.hidden_size))
            self.mlp_res_norm = nn.Parameter(torch.ones(config.hidden_size))

    def attention(self, x: torch.Tensor, batch: StepBatch, cache: CachePools) -> torch.Tensor:
        if x.shape[0] == 0:      # a data-parallel rank without work this step: only its MoE joins the others
            return torch.zeros_like(x)
        if self.kind == KDA:
            return self.self_attn(x, batch, cache.conv[self.index], cache.recurrent[self.index])
        return self.self_attn(x, batch, cache.mla[self.index], cache.page_format(self.index))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


def attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """K3 attention residual: a softmax over depth of the stored block sums and the running partial sum, each
    scored by its RMS-normalized dot product with the query w = norm.weight * proj.weight (fp32)."""
    return norm_ops.attn_res_mix(blocks, partial, norm_w.float() * proj_w.float().view(-1), eps)


class KimiModel(nn.Module):
    """Kimi Linear or Kimi K3 (the text model), one step at a time.

    Hidden-state capture (a speculative drafter's input): set `capture_layers` to target layer indices (0-based);
    after each forward `captured_hidden[l]` is the [T, hidden] output of layer l for every row of the batch. The
    output of a layer is the residual stream after it; with K3's attention residuals it is the running sum of the
    layer's block after it (`partial` in the mix recurrence), as vLLM's K3 model hands its DSpark drafter
    (`prefix_sum + hidden_states` after the layer).

    `mapping`: this rank's part of a layout over several ranks (every rank runs the same step in lockstep; see the
    module docstring)."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, mapping: Mapping | None = None):
        super().__init__()
        c = self.config = config
        self.captured_hidden: dict[int, torch.Tensor] = {}
        self.mapping = mapping or Mapping()
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, mapping) for i in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self._verify_segments: tuple[int, ...] = ()
        self._verify_slots: dict[int, int] = {}
        if not c.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        if c.attn_res_block_size:
            self.output_attn_res_proj = nn.Parameter(torch.empty(1, c.hidden_size))
            self.output_attn_res_norm = nn.Parameter(torch.ones(c.hidden_size))

    # speculative decoding: verify blocks (StepBatch.verify_segments) run with KDA replay, committed here
    supports_verify = True

    @torch.no_grad()
    def commit_verify(self, accepted: list[int], cache: CachePools) -> None:
        """After a step with verify blocks: `accepted[i]` (1..block length; 0 for a padding block, whose state is
        left alone) leading tokens of the i-th verify
        segment (in `verify_segments` order) are kept; every KDA layer advances that request's conv and recurrent
        state over exactly those tokens from the state before the block. Call it once per such step, before the
        next forward (MLA needs nothing: latents past the accepted tokens are never read, and later overwritten)."""
        segs = self._verify_segments
        if len(accepted) != len(segs):
            raise ValueError(f"{len(accepted)} accepted counts for {len(segs)} verify blocks")
        by_seg = dict(zip(segs, accepted))
        for layer in self.layers:
            if layer.kind == KDA:
                layer.self_attn.commit_verify(by_seg, self._verify_slots, cache.conv[layer.index],
                                              cache.recurrent[layer.index])
        self._verify_segments = ()

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.config.tie_word_embeddings else self.lm_head

    @torch.no_grad()
    def forward(self, batch: StepBatch, cache: CachePools) -> torch.Tensor:
        """Logits [N, vocab] (fp32) for the rows batch.logits_indices; the cache pools are updated in place."""
        c = self.config
        self._verify_segments = tuple(batch.verify_segments)
        if self._verify_segments:
            slots = batch.slot_list
            self._verify_slots = {b: slots[b] for b in self._verify_segments}
        capture = set(self.capture_layers)
        self.captured_hidden = {}
        h = F.embedding(batch.token_ids, self.embed_tokens)
        if c.attn_res_block_size:
            h = self._forward_attn_res(h, batch, cache, capture)
        else:
            for i, layer in enumerate(self.layers):
                h = h + layer.attention(rms_norm(h, layer.input_layernorm, c.rms_norm_eps), batch, cache)
                h = h + layer.ffn(rms_norm(h, layer.post_attention_layernorm, c.rms_norm_eps))
                if i in capture:
                    self.captured_hidden[i] = h
        h = rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)
        return h.float() @ self.head_weight().float().t()

    def _forward_attn_res(self, h: torch.Tensor, batch: StepBatch, cache: CachePools,
                          capture: set[int] = frozenset()) -> torch.Tensor:
        c = self.config
        eps = c.rms_norm_eps
        blocks: list[torch.Tensor] = []
        partial: torch.Tensor | None = h
        for i, layer in enumerate(self.layers):
            x = attn_res_mix(blocks, partial, layer.self_attention_res_norm, layer.self_attention_res_proj, eps)
            if i % c.attn_res_block_size == 0:
                blocks.append(partial)
                partial = None
            y = layer.attention(rms_norm(x, layer.input_layernorm, eps), batch, cache)
            partial = y if partial is None else partial + y
            x = attn_res_mix(blocks, partial, layer.mlp_res_norm, layer.mlp_res_proj, eps)
            partial = partial + layer.ffn(rms_norm(x, layer.post_attention_layernorm, eps))
            if i in capture:
                self.captured_hidden[i] = partial
        return attn_res_mix(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj, eps)
