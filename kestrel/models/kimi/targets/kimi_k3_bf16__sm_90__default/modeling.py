"""Kimi K3, bf16 weights, Hopper, one GPU: one flat forward built only from catalog entries.

Reads the same `StepBatch` and `CachePools` as the reference implementation and returns the same logits (within
the entries' bounds). Weights come from the loaded reference model, regrouped once at build time for the kernels:
q / k / v projections and the dense / shared GLU projections fused, conv weights stacked, kv_b_proj split per head
into W_UK and W_UV^T for the absorbed decode, attention-residual query vectors folded (norm.weight * proj.weight).
"""

from __future__ import annotations

import torch

from kestrel.catalog.attention.mla_cache_write import MlaCacheWrite
from kestrel.catalog.attention.mla_decode import MlaDecode
from kestrel.catalog.attention.mla_gather import MlaGather
from kestrel.catalog.attention.mla_prefill import MlaPrefill
from kestrel.catalog.attention.output_gate import SigmoidGate
from kestrel.catalog.embedding.embed import Embedding
from kestrel.catalog.embedding.lm_head import LmHead
from kestrel.catalog.gemm.head_bmm import HeadBmm
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.catalog.moe.experts import MoeExperts
from kestrel.catalog.moe.glu import SituGlu
from kestrel.catalog.moe.router import MoeRouter
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.attn_res_mix import AttnResMix
from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm
from kestrel.catalog._step_plan import MAX_VERIFY, StepPlan
from kestrel.config import ModelConfig

LOWRANK_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm


def _w(model, name: str) -> torch.Tensor:
    return model.get_parameter(name).detach()


class K3Target:
    def __init__(self, model, config: ModelConfig):
        c = self.c = config
        self.embed = _w(model, "embed_tokens")
        self.head = self.embed if c.tie_word_embeddings else _w(model, "lm_head")
        self.final_norm = _w(model, "norm")
        self.final_mix = (_w(model, "output_attn_res_norm").float() * _w(model, "output_attn_res_proj").float()
                          .view(-1)).contiguous()
        self.layers = [self._layer(model, i) for i in range(c.num_layers)]

    def _layer(self, model, i: int) -> dict:
        c, p = self.c, f"layers.{i}."
        L = {"kind": c.layer_kinds[i], "in_norm": _w(model, p + "input_layernorm"),
             "post_norm": _w(model, p + "post_attention_layernorm"),
             "attn_mix": (_w(model, p + "self_attention_res_norm").float()
                          * _w(model, p + "self_attention_res_proj").float().view(-1)).contiguous(),
             "mlp_mix": (_w(model, p + "mlp_res_norm").float() * _w(model, p + "mlp_res_proj").float().view(-1))
             .contiguous()}
        a = p + "self_attn."
        if L["kind"] == "kda":
            L["qkv"] = torch.cat([_w(model, a + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")]).contiguous()
            L["conv"] = torch.cat([_w(model, a + n) for n in ("q_conv1d", "k_conv1d", "v_conv1d")]).squeeze(1) \
                .contiguous()
            L["f_a"], L["f_b"] = _w(model, a + "f_a_proj.weight"), _w(model, a + "f_b_proj.weight")
            L["b"] = _w(model, a + "b_proj.weight")
            L["A_log"] = _w(model, a + "A_log").float().contiguous()
            L["dt_bias"] = _w(model, a + "dt_bias").float().contiguous()
            L["g"] = _w(model, a + "g_proj.weight")
            L["o_norm"] = _w(model, a + "o_norm").float().contiguous()
            L["o"] = _w(model, a + "o_proj.weight")
        else:
            H = c.num_heads
            L["q_a"], L["q_a_norm"] = _w(model, a + "q_a_proj.weight"), _w(model, a + "q_a_layernorm")
            L["q_b"] = _w(model, a + "q_b_proj.weight")
            L["kv_a"], L["kv_norm"] = _w(model, a + "kv_a_proj_with_mqa.weight"), _w(model, a + "kv_a_layernorm")
            kv_b = _w(model, a + "kv_b_proj.weight")
            L["kv_b"] = kv_b
            per_head = kv_b.view(H, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            L["w_uk"] = per_head[:, :c.qk_nope_head_dim].contiguous()                    # [H, nope, L]
            L["w_uv_t"] = per_head[:, c.qk_nope_head_dim:].transpose(1, 2).contiguous()  # [H, L, v]
            L["g"] = _w(model, a + "g_proj.weight")
            L["o"] = _w(model, a + "o_proj.weight")
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            L["router"], L["bias"] = _w(model, m + "gate.weight"), _w(model, m + "gate.e_score_correction_bias").float()
            L["w13"], L["w2"] = _w(model, m + "experts.w13"), _w(model, m + "experts.w2")
            L["down"], L["up"] = _w(model, m + "routed_expert_down_proj.weight"), _w(model, m + "routed_expert_up_proj.weight")
            L["latent_norm"] = _w(model, m + "routed_expert_norm")
            L["shared_gu"] = torch.cat([_w(model, m + "shared_experts.gate_proj.weight"),
                                        _w(model, m + "shared_experts.up_proj.weight")]).contiguous()
            L["shared_down"] = _w(model, m + "shared_experts.down_proj.weight")
        else:
            L["dense_gu"] = torch.cat([_w(model, p + "mlp.gate_proj.weight"), _w(model, p + "mlp.up_proj.weight")]) \
                .contiguous()
            L["dense_down"] = _w(model, p + "mlp.down_proj.weight")
        return L

    # ---- pieces --------------------------------------------------------------------------------------------
    def _glu_mlp(self, x, gu_w, down_w):
        c = self.c
        return Linear.raw_call(SituGlu.raw_call(Linear.raw_call(x, gu_w), c.situ_beta, c.situ_linear_beta), down_w)

    def _ffn(self, L, x):
        c = self.c
        if "dense_gu" in L:
            return self._glu_mlp(x, L["dense_gu"], L["dense_down"])
        ids, weights = MoeRouter.raw_call(x, L["router"], L["bias"], c.num_experts_per_tok, c.n_group, c.topk_group,
                                          c.norm_topk_prob, c.routed_scaling_factor)
        z = Linear.raw_call(x, L["down"])
        r = MoeExperts.raw_call(z, L["w13"], L["w2"], ids, weights, "situ", c.situ_beta, c.situ_linear_beta)
        r, _ = AddRmsNorm.raw_call(r, None, L["latent_norm"], c.rms_norm_eps)
        out = Linear.raw_call(r, L["up"])
        return out.add_(self._glu_mlp(x, L["shared_gu"], L["shared_down"]))

    def _kda(self, L, x, batch, step, conv_state, rec_state):
        c = self.c
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
                out, _ = KdaChunkPrefill.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
            if rows is None:
                o = out
            else:
                o.index_copy_(0, rows, out)
            for slot, snap in snaps:
                conv_state[snap].copy_(conv_state[slot])
                rec_state[snap].copy_(rec_state[slot])
        gate = Linear.raw_call(x, L["g"])
        y = GatedRmsNorm.raw_call(o.view(-1, D), gate.view(-1, D), L["o_norm"], c.rms_norm_eps)
        return Linear.raw_call(y.view(x.shape[0], -1), L["o"])

    def _mla(self, L, x, batch, step, pages):
        c = self.c
        H, Lr = c.num_heads, c.kv_lora_rank
        qa, _ = AddRmsNorm.raw_call(Linear.raw_call(x, L["q_a"]), None, L["q_a_norm"], LOWRANK_EPS)
        q = Linear.raw_call(qa, L["q_b"]).view(-1, H, c.qk_head_dim)
        kv = Linear.raw_call(x, L["kv_a"])
        latent, _ = AddRmsNorm.raw_call(kv[:, :Lr], None, L["kv_norm"], LOWRANK_EPS)
        MlaCacheWrite.raw_call(latent, kv[:, Lr:], pages, batch.block_tables, step.req_idx, batch.positions)
        if step.max_len <= MAX_VERIFY:
            q_abs = torch.cat([HeadBmm.raw_call(q[..., :c.qk_nope_head_dim], L["w_uk"]),
                               q[..., c.qk_nope_head_dim:]], dim=-1).contiguous()
            o_lat, _ = MlaDecode.raw_call(q_abs, pages, batch.block_tables, step.req_idx, step.kv_lens,
                                          c.softmax_scale, Lr, step.num_splits)
            o = HeadBmm.raw_call(o_lat, L["w_uv_t"])
        else:
            ctx = MlaGather.raw_call(pages, step.ctx_rows)
            kvb = Linear.raw_call(ctx[:, :Lr].contiguous(), L["kv_b"]).view(-1, H, c.qk_nope_head_dim + c.v_head_dim)
            k = torch.cat([kvb[..., :c.qk_nope_head_dim],
                           ctx[:, Lr:].unsqueeze(1).expand(-1, H, -1)], dim=-1).contiguous()
            v = kvb[..., c.qk_nope_head_dim:].contiguous()
            o = MlaPrefill.raw_call(q.contiguous(), k, v, step.cu_q, step.cu_k, c.softmax_scale)
        o = SigmoidGate.raw_call(o.reshape(x.shape[0], -1).contiguous(), Linear.raw_call(x, L["g"]))
        return Linear.raw_call(o, L["o"])

    # ---- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, batch, pools) -> torch.Tensor:
        c = self.c
        step = StepPlan(batch, pools.page_size)
        eps = c.rms_norm_eps
        T, N = batch.token_ids.shape[0], c.hidden_size
        max_blocks = -(-c.num_layers // c.attn_res_block_size) + 1
        blocks = torch.empty(max_blocks, T, N, dtype=self.embed.dtype, device=self.embed.device)
        nb = 0
        partial = Embedding.raw_call(batch.token_ids, self.embed)
        for i, L in enumerate(self.layers):
            x = AttnResMix.raw_call(blocks[:nb], partial, L["attn_mix"], eps)
            if i % c.attn_res_block_size == 0:
                blocks[nb].copy_(partial)
                nb += 1
                partial = None
            xn, _ = AddRmsNorm.raw_call(x, None, L["in_norm"], eps)
            if L["kind"] == "kda":
                y = self._kda(L, xn, batch, step, pools.conv[i], pools.recurrent[i])
            else:
                y = self._mla(L, xn, batch, step, pools.mla[i])
            partial = y if partial is None else partial.add_(y)
            x = AttnResMix.raw_call(blocks[:nb], partial, L["mlp_mix"], eps)
            xn, _ = AddRmsNorm.raw_call(x, None, L["post_norm"], eps)
            partial = partial.add_(self._ffn(L, xn))
        h = AttnResMix.raw_call(blocks[:nb], partial, self.final_mix, eps).index_select(0, batch.logits_indices)
        h, _ = AddRmsNorm.raw_call(h, None, self.final_norm, eps)
        return LmHead.raw_call(h, self.head)


def build(model, config: ModelConfig) -> K3Target:
    return K3Target(model, config)
