"""The reference implementation of Kimi Linear and Kimi K3: plain torch, any device, any dtype.

This file is the executable spec every fast path is checked against, so it favours the obvious formulation over a
fast one. It runs one *step*: a flat batch of tokens from several requests (prefill chunks and decode tokens mixed),
reading and writing the runtime's cache pools (paged MLA latents, KDA state slots). Parameter names follow
Moonshot's checkpoint layout (see weights.py for the other spellings), with routed experts stacked per layer as
`w13` [E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I].

Numerics: norms, router, softmax, activations, KDA gates and recurrence in fp32; matmuls in the model dtype. The
maths of those ops is written once, in `kestrel/ops/`, and called from here and from the catalog entries'
`reference`, so the model and the kernels' certification share one spec.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import KDA, ModelConfig
from kestrel.models.kimi.step import CachePools, StepBatch
from kestrel.ops import attention as attention_ops
from kestrel.ops import kda as kda_ops
from kestrel.ops import moe as moe_ops
from kestrel.ops import norm as norm_ops

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
    def __init__(self, config: ModelConfig, hidden: int, inter: int):
        super().__init__()
        self.config = config
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.config))


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
    z = routed_expert_down_proj(x), normalizes their weighted sum and projects it back up; shared experts see x."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        width = c.routed_expert_hidden_size or c.hidden_size
        self.gate = Router(config)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(c.num_experts, 2 * c.moe_intermediate_size, width))
        self.experts.w2 = nn.Parameter(torch.empty(c.num_experts, width, c.moe_intermediate_size))
        if c.n_shared_experts:
            self.shared_experts = DenseMLP(config, c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
        if c.routed_expert_hidden_size:
            self.routed_expert_down_proj = _linear(c.hidden_size, width)
            self.routed_expert_up_proj = _linear(width, c.hidden_size)
            if c.latent_moe_use_norm:
                self.routed_expert_norm = nn.Parameter(torch.ones(width))

    def routed(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        c = self.config
        return moe_ops.experts(z, _PerExpert(self.experts.w13), _PerExpert(self.experts.w2), ids, weights,
                               c.hidden_act, c.situ_beta, c.situ_linear_beta).to(z.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        if self.config.routed_expert_hidden_size:
            y = self.routed(self.routed_expert_down_proj(x), ids, weights)
            if self.config.latent_moe_use_norm:
                y = rms_norm(y, self.routed_expert_norm, self.config.rms_norm_eps)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x, ids, weights)
        if self.config.n_shared_experts:
            y = y + self.shared_experts(x)
        return y


# ---------------------------------------------------------------------------------------------------------------
# KDA: Kimi delta attention

class KdaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        H, D, W, K = c.kda_num_heads, c.kda_head_dim, c.kda_width, c.conv_kernel_size
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
        H, D = c.kda_num_heads, c.kda_head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g, beta = self.gates(x)
        o = torch.empty(x.shape[0], H, D, dtype=torch.float32, device=x.device)
        snapshot_after = dict(batch.snapshots)
        verify = set(batch.verify_segments)
        # the replay buffer: per verify segment, the block's conv inputs and its post-conv q / k / v, g, beta
        self.replay: dict[int, tuple[torch.Tensor, ...]] = {}
        for rows, slots, b in _segment_groups(batch, snapshot_after, x.device, verify):
            B = len(slots)
            q, k, v = self.short_conv(mixed, conv_state, rows, slots, update=b not in verify).split(c.kda_width,
                                                                                                  dim=-1)
            q, k, v = (t.reshape(B, -1, H, D) for t in (q, k, v))
            gb, bb = g[rows].view(B, -1, H, D), beta[rows].view(B, -1, H)
            out, final = kda_ops.recurrence(q, k, v, gb, bb, rec_state[slots])
            o[rows] = out.reshape(-1, H, D)
            if b in verify:          # the state stays as it was before the block until commit_verify
                self.replay[b] = (mixed[rows], q[0], k[0], v[0], gb[0], bb[0])
                continue
            rec_state[slots] = final
            if b in snapshot_after:
                conv_state[snapshot_after[b]] = conv_state[slots[0]]
                rec_state[snapshot_after[b]] = rec_state[slots[0]]
        gate = self.g_proj(x) if c.kda_full_rank_output_gate else self.g_b_proj(self.g_a_proj(x))
        o = norm_ops.gated_rms_norm(o, gate.view(-1, H, D), self.o_norm, c.rms_norm_eps)
        return self.o_proj(o.to(x.dtype).reshape(x.shape[0], -1))

    def commit_verify(self, accepted: dict[int, int], slots: dict[int, int], conv_state: torch.Tensor,
                      rec_state: torch.Tensor) -> None:
        """Advance each verify segment's state over its first `accepted[b]` tokens only, from the state the block
        started from (still in slot `slots[b]`), replaying the inputs the forward kept."""
        for b, n in accepted.items():
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
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        H = c.num_heads
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
            self.g_proj = _linear(c.hidden_size, H * c.v_head_dim)
        self.o_proj = _linear(H * c.v_head_dim, c.hidden_size)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.q_lora_rank:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_layernorm, MLA_LOWRANK_NORM_EPS))
        else:
            q = self.q_proj(x)
        return q.view(-1, c.num_heads, c.qk_head_dim)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token cache entry: [normalized c_kv (kv_lora_rank) | k_pe (rope dim, never rotated: NoPE)]."""
        c = self.config
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        return torch.cat([rms_norm(ckv, self.kv_a_layernorm, MLA_LOWRANK_NORM_EPS), k_pe], dim=-1)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into W_UK [H, nope, L] and W_UV [H, v, L]."""
        c = self.config
        w = weight(self.kv_b_proj.weight).view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def attend_expanded(self, q: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Prefill form: expand the context latents to per-head keys and values. q [L, H, Dqk], ctx [S, W]."""
        c = self.config
        L_ = c.kv_lora_rank
        kv = self.kv_b_proj(ctx[:, :L_]).view(-1, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = ctx[:, L_:].unsqueeze(1).expand(-1, c.num_heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        visible = torch.arange(ctx.shape[0], device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1)   # [L, S]
        o, _ = attention_ops.attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), c.softmax_scale,
                                       visible)                                                   # [H, L, v]
        return o.transpose(0, 1).to(q.dtype)

    def attend_absorbed(self, q: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Decode form: fold W_UK into the query and W_UV into the output, so attention runs over one latent head
        of width kv_lora + rope. q [B, H, Dqk], ctx [B, S, W], mask [B, S] (True = visible)."""
        c = self.config
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = q.float().split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_abs = torch.cat([torch.einsum("bhn,hnl->bhl", q_nope, w_uk.float()), q_pe], dim=-1)   # [B, H, W]
        o_lat, _ = attention_ops.attention(q_abs, ctx, ctx[..., :c.kv_lora_rank], c.softmax_scale, mask.unsqueeze(1))
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv.float()).to(q.dtype)

    def forward(self, x: torch.Tensor, batch: StepBatch, pages: torch.Tensor) -> torch.Tensor:
        c = self.config
        q = self.query(x)
        write_latents(pages, batch, self.latent(x))
        o = torch.empty(x.shape[0], c.num_heads, c.v_head_dim, dtype=x.dtype, device=x.device)
        decode = [b for b in range(batch.num_reqs) if batch.seq_len(b) == 1]
        if decode:
            # single-token segments are batched together: that is where a server spends its steps
            rows = torch.tensor([batch.cu_seqlens[b] for b in decode], device=x.device)
            lens = [batch.context_lens[b] + 1 for b in decode]
            ctx = torch.stack([_pad(read_latents(pages, batch, b, n), max(lens)) for b, n in zip(decode, lens)])
            mask = torch.arange(max(lens), device=x.device).unsqueeze(0) < torch.tensor(lens, device=x.device).unsqueeze(1)
            o[rows] = self.attend_absorbed(q[rows], ctx, mask)
        for b in range(batch.num_reqs):
            if batch.seq_len(b) == 1:
                continue
            s, e = batch.cu_seqlens[b], batch.cu_seqlens[b + 1]
            ctx = read_latents(pages, batch, b, batch.context_lens[b] + (e - s))
            o[s:e] = self.attend_expanded(q[s:e], ctx, batch.positions[s:e])
        if c.mla_use_output_gate:
            o = o * torch.sigmoid(self.g_proj(x).float()).view_as(o).to(o.dtype)
        return self.o_proj(o.reshape(x.shape[0], -1))


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, n - t.shape[0]))


def write_latents(pages: torch.Tensor, batch: StepBatch, latents: torch.Tensor) -> None:
    """Store each token's latent at its position in its request's pages."""
    page_size = pages.shape[1]
    req = torch.repeat_interleave(torch.arange(batch.num_reqs, device=latents.device),
                                  torch.tensor([batch.seq_len(b) for b in range(batch.num_reqs)], device=latents.device))
    page = batch.block_tables[req, batch.positions // page_size].long()
    pages[page, batch.positions % page_size] = latents.to(pages.dtype)


def read_latents(pages: torch.Tensor, batch: StepBatch, b: int, n: int) -> torch.Tensor:
    """The first n cached latents of request b, in position order: [n, W]."""
    page_size = pages.shape[1]
    n_pages = -(-n // page_size)
    return pages[batch.block_tables[b, :n_pages].long()].reshape(-1, pages.shape[-1])[:n]


# ---------------------------------------------------------------------------------------------------------------
# the model

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, i: int):
        super().__init__()
        self.index, self.kind = i, config.layer_kinds[i]
        self.self_attn = KdaAttention(config) if self.kind == KDA else MlaAttention(config)
        self.input_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(config.hidden_size))
        if config.is_moe_layer(i):
            self.block_sparse_moe = MoE(config)
        else:
            self.mlp = DenseMLP(config, config.hidden_size, config.intermediate_size)
        if config.attn_res_block_size:
            self.self_attention_res_proj = nn.Parameter(torch.empty(1, config.hidden_size))
            self.self_attention_res_norm = nn.Parameter(torch.ones(config.hidden_size))
            self.mlp_res_proj = nn.Parameter(torch.empty(1, config.hidden_size))
            self.mlp_res_norm = nn.Parameter(torch.ones(config.hidden_size))

    def attention(self, x: torch.Tensor, batch: StepBatch, cache: CachePools) -> torch.Tensor:
        if self.kind == KDA:
            return self.self_attn(x, batch, cache.conv[self.index], cache.recurrent[self.index])
        return self.self_attn(x, batch, cache.mla[self.index])

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


def attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """K3 attention residual: a softmax over depth of the stored block sums and the running partial sum, each
    scored by its RMS-normalized dot product with the query w = norm.weight * proj.weight (fp32)."""
    return norm_ops.attn_res_mix(blocks, partial, norm_w.float() * proj_w.float().view(-1), eps)


class KimiModel(nn.Module):
    """Kimi Linear or Kimi K3 (the text model), one step at a time."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(c.num_layers))
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
        """After a step with verify blocks: `accepted[i]` (1..block length) leading tokens of the i-th verify
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
        h = F.embedding(batch.token_ids, self.embed_tokens)
        if c.attn_res_block_size:
            h = self._forward_attn_res(h, batch, cache)
        else:
            for layer in self.layers:
                h = h + layer.attention(rms_norm(h, layer.input_layernorm, c.rms_norm_eps), batch, cache)
                h = h + layer.ffn(rms_norm(h, layer.post_attention_layernorm, c.rms_norm_eps))
        h = rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)
        return h.float() @ self.head_weight().float().t()

    def _forward_attn_res(self, h: torch.Tensor, batch: StepBatch, cache: CachePools) -> torch.Tensor:
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
        return attn_res_mix(blocks, partial, self.output_attn_res_norm, self.output_attn_res_proj, eps)
