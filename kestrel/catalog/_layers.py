"""Layer pieces both Kimi targets run the same way, composed only of catalog entries.

Targets never import each other, so what they share lives here (underscore: not an entry; the entries it launches
are certified on their own). Each target keeps its own flat forward and passes in what differs: the KDA output
gate projection, the MLA query and output gate, the GLU activation.

Weights come from the loaded reference model, regrouped once for the kernels: q / k / v and gate / up projections
fused, conv weights stacked, kv_b_proj split per head into W_UK and W_UV^T for the absorbed decode.
"""

from __future__ import annotations

import torch

from kestrel.catalog._step_plan import MAX_VERIFY
from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
from kestrel.catalog.attention.mla_decode import MlaDecode
from kestrel.catalog.attention.mla_gather import MlaGather
from kestrel.catalog.attention.mla_prefill import MlaPrefill
from kestrel.catalog.gemm.head_bmm import HeadBmm
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda.chunk_fla import KdaChunkFla
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.catalog.moe.router import MoeRouter
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm

LOWRANK_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm


def param(model, name: str) -> torch.Tensor:
    return model.get_parameter(name).detach()


def fused(model, names: list[str]) -> torch.Tensor:
    return torch.cat([param(model, n) for n in names]).contiguous()


# ---- weights ---------------------------------------------------------------------------------------------------
def kda_weights(model, a: str) -> dict:
    """The KDA weights every variant has (`a` = "layers.{i}.self_attn."); the output gate is the target's."""
    return {"qkv": fused(model, [a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj")]),
            "conv": fused(model, [a + n for n in ("q_conv1d", "k_conv1d", "v_conv1d")]).squeeze(1).contiguous(),
            "f_a": param(model, a + "f_a_proj.weight"), "f_b": param(model, a + "f_b_proj.weight"),
            "b": param(model, a + "b_proj.weight"),
            "A_log": param(model, a + "A_log").float().contiguous(),
            "dt_bias": param(model, a + "dt_bias").float().contiguous(),
            "o_norm": param(model, a + "o_norm").float().contiguous(),
            "o": param(model, a + "o_proj.weight")}


def mla_weights(model, a: str, c) -> dict:
    """The MLA weights every variant has; the query path and the output gate are the target's."""
    kv_b = param(model, a + "kv_b_proj.weight")
    per_head = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return {"kv_a": param(model, a + "kv_a_proj_with_mqa.weight"), "kv_norm": param(model, a + "kv_a_layernorm"),
            "kv_b": kv_b,
            "w_uk": per_head[:, :c.qk_nope_head_dim].contiguous(),                     # [H, nope, L]
            "w_uv_t": per_head[:, c.qk_nope_head_dim:].transpose(1, 2).contiguous(),   # [H, L, v]
            "o": param(model, a + "o_proj.weight")}


def ffn_weights(model, p: str, moe: bool) -> dict:
    """Router, stacked experts and shared experts of a MoE layer, or the dense GLU MLP (`p` = "layers.{i}.")."""
    if not moe:
        return {"dense_gu": fused(model, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                "dense_down": param(model, p + "mlp.down_proj.weight")}
    m = p + "block_sparse_moe."
    # the router GEMM runs in fp32: upcast its weight once here, not on every call
    return {"router": param(model, m + "gate.weight").float().contiguous(),
            "bias": param(model, m + "gate.e_score_correction_bias").float(),
            "w13": param(model, m + "experts.w13"), "w2": param(model, m + "experts.w2"),
            "shared_gu": fused(model, [m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight"]),
            "shared_down": param(model, m + "shared_experts.down_proj.weight")}


# ---- compute ---------------------------------------------------------------------------------------------------
def route(L: dict, x: torch.Tensor, c):
    return MoeRouter.raw_call(x, L["router"], L["bias"], c.num_experts_per_tok, c.n_group, c.topk_group,
                              c.norm_topk_prob, c.routed_scaling_factor)


def kda(L: dict, x: torch.Tensor, gate: torch.Tensor, step, conv_state, rec_state, c) -> torch.Tensor:
    """KDA over the step's segments (in waves, see StepPlan), then the gated per-head norm and o_proj.
    `gate` [T, H*D] is the target's output-gate projection of x."""
    H, D = c.kda_num_heads, c.kda_head_dim
    mixed = Linear.raw_call(x, L["qkv"])
    f = Linear.raw_call(Linear.raw_call(x, L["f_a"]), L["f_b"])
    g, beta = KdaGate.raw_call(f, L["A_log"], L["dt_bias"], Linear.raw_call(x, L["b"]), c.gate_lower_bound)
    o = torch.empty(x.shape[0], H, D, dtype=x.dtype, device=x.device)
    for rows, cu, slots, snaps in step.kda_waves:
        part = mixed if rows is None else mixed.index_select(0, rows)
        qkv, _ = ShortConv.raw_call(part, L["conv"], conv_state, cu, slots)
        q, k, v = (t.view(-1, H, D) for t in qkv.split(c.kda_width, dim=-1))
        gw, bw = (g, beta) if rows is None else (g.index_select(0, rows), beta.index_select(0, rows))
        if step.max_len <= MAX_VERIFY:
            out, _ = KdaRecurrent.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
        else:
            # fla-core's chunked KDA where it runs (H200, 8K tokens x 32 heads: 1.99 ms against our 4.96 ms,
            # benchmarks/results/kda_prefill_h200.json), else ours: the same contract, both certified
            if KdaChunkFla.runs_on(q):
                out, _ = KdaChunkFla.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
            else:
                out, _ = KdaChunkPrefill.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
        if rows is None:
            o = out
        else:
            o.index_copy_(0, rows, out)
        for slot, snap in snaps:
            conv_state[snap].copy_(conv_state[slot])
            rec_state[snap].copy_(rec_state[slot])
    y = GatedRmsNorm.raw_call(o.view(-1, D), gate.view(-1, D), L["o_norm"], c.rms_norm_eps)
    return Linear.raw_call(y.view(x.shape[0], -1), L["o"])


def mla_attention(L: dict, x: torch.Tensor, q: torch.Tensor, batch, step, pages, c) -> torch.Tensor:
    """Write x's latents into the pages and attend with q [T, H, nope + rope]: the absorbed form over the latent
    when every segment is short (decode, verify), else the expanded form. Returns [T, H * v] before o_proj."""
    H, Lr = c.num_heads, c.kv_lora_rank
    kv = Linear.raw_call(x, L["kv_a"])
    latent, _ = AddRmsNorm.raw_call(kv[:, :Lr], None, L["kv_norm"], LOWRANK_EPS)
    MlaCacheWrite.raw_call(latent, kv[:, Lr:], pages, batch.block_tables, step.req_idx, batch.positions)
    if step.max_len <= MAX_VERIFY:
        o = _mla_absorbed(L, q, pages, batch.block_tables, step.req_idx, step.kv_lens, step.num_splits, c)
    elif step.mla_split is None:
        o = _mla_expanded(L, q, pages, step.ctx_rows, step.cu_q, step.cu_k, c)
    else:   # a mixed step: short segments absorbed, long ones expanded over their own context only
        short, long = step.mla_split
        o = q.new_empty(q.shape[0], H, c.v_head_dim)
        o.index_copy_(0, short, _mla_absorbed(L, q.index_select(0, short), pages, batch.block_tables,
                                              step.req_idx.index_select(0, short),
                                              step.kv_lens.index_select(0, short), step.num_splits, c))
        o.index_copy_(0, long, _mla_expanded(L, q.index_select(0, long), pages, step.ctx_rows, step.cu_q_long,
                                             step.cu_k, c))
    return o.reshape(x.shape[0], -1).contiguous()


def _mla_absorbed(L: dict, q, pages, block_tables, req_idx, kv_lens, num_splits: int, c) -> torch.Tensor:
    """Attention over the cached latents: q_nope absorbed into the latent space, values back through w_uv."""
    q_abs = torch.cat([HeadBmm.raw_call(q[..., :c.qk_nope_head_dim], L["w_uk"]),
                       q[..., c.qk_nope_head_dim:]], dim=-1).contiguous()
    o_lat, _ = MlaDecode.raw_call(q_abs, pages, block_tables, req_idx, kv_lens, c.softmax_scale, c.kv_lora_rank,
                                  num_splits)
    return HeadBmm.raw_call(o_lat, L["w_uv_t"])


def _mla_expanded(L: dict, q, pages, ctx_rows, cu_q, cu_k, c) -> torch.Tensor:
    """Attention with every context latent expanded to per-head keys and values (prefill segments)."""
    H, Lr = c.num_heads, c.kv_lora_rank
    ctx = MlaGather.raw_call(pages, ctx_rows)
    kvb = Linear.raw_call(ctx[:, :Lr].contiguous(), L["kv_b"]).view(-1, H, c.qk_nope_head_dim + c.v_head_dim)
    k = torch.cat([kvb[..., :c.qk_nope_head_dim], ctx[:, Lr:].unsqueeze(1).expand(-1, H, -1)], dim=-1).contiguous()
    v = kvb[..., c.qk_nope_head_dim:].contiguous()
    return MlaPrefill.raw_call(q.contiguous(), k, v, cu_q, cu_k, c.softmax_scale)
