"""Kimi K3, bf16 weights, Hopper, one GPU: one flat forward built only from catalog entries.

Reads the same `StepBatch` and `CachePools` as the reference implementation and returns the same logits (within
the entries' bounds). K3's own pieces are here: attention residuals (query vectors folded once as
norm.weight * proj.weight), the q-LoRA query, the MLA and full-rank KDA output gates, the latent MoE with SiTU.
The layer pieces both targets run the same way come from `catalog/_layers.py`.
"""

from __future__ import annotations

import torch

from kestrel.catalog import _layers as layers
from kestrel.catalog._step_plan import StepPlan, decode_variant, decode_variants
from kestrel.catalog.attention.output_gate import SigmoidGate
from kestrel.catalog.embedding.embed import Embedding
from kestrel.catalog.embedding.lm_head import LmHead
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.moe.experts import MoeExperts
from kestrel.catalog.moe.glu import SituGlu
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.attn_res_mix import AttnResMix
from kestrel.config import ModelConfig

param = layers.param


def _mix_query(model, name: str) -> torch.Tensor:
    """An attention-residual query vector: `<name>_norm.weight * <name>_proj.weight`, fp32."""
    return (param(model, name + "_norm").float() * param(model, name + "_proj").float().view(-1)).contiguous()


class K3Target:
    # runtime/graphs.py may capture the decode step in CUDA graphs: no host sync, static shapes per bucket
    capturable = True
    decode_variant = staticmethod(decode_variant)
    decode_variants = staticmethod(decode_variants)

    def __init__(self, model, config: ModelConfig):
        c = self.c = config
        self.embed = param(model, "embed_tokens")
        self.head = self.embed if c.tie_word_embeddings else param(model, "lm_head")
        self.final_norm = param(model, "norm")
        self.final_mix = _mix_query(model, "output_attn_res")
        self.layers = [self._layer(model, i) for i in range(c.num_layers)]

    def _layer(self, model, i: int) -> dict:
        c, p = self.c, f"layers.{i}."
        a = p + "self_attn."
        L = {"kind": c.layer_kinds[i], "in_norm": param(model, p + "input_layernorm"),
             "post_norm": param(model, p + "post_attention_layernorm"),
             "attn_mix": _mix_query(model, p + "self_attention_res"), "mlp_mix": _mix_query(model, p + "mlp_res"),
             **layers.ffn_weights(model, p, c.is_moe_layer(i)), "g": param(model, a + "g_proj.weight")}
        if L["kind"] == "kda":
            L.update(layers.kda_weights(model, a))
        else:
            L.update(layers.mla_weights(model, a, c), q_a=param(model, a + "q_a_proj.weight"),
                     q_a_norm=param(model, a + "q_a_layernorm"), q_b=param(model, a + "q_b_proj.weight"))
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            L.update(down=param(model, m + "routed_expert_down_proj.weight"),
                     up=param(model, m + "routed_expert_up_proj.weight"),
                     latent_norm=param(model, m + "routed_expert_norm"))
        return L

    def _glu_mlp(self, x, gu_w, down_w):
        c = self.c
        return Linear.raw_call(SituGlu.raw_call(Linear.raw_call(x, gu_w), c.situ_beta, c.situ_linear_beta), down_w)

    def _ffn(self, L, x):
        c = self.c
        if "dense_gu" in L:
            return self._glu_mlp(x, L["dense_gu"], L["dense_down"])
        ids, weights = layers.route(L, x, c)
        z = Linear.raw_call(x, L["down"])
        r = MoeExperts.raw_call(z, L["w13"], L["w2"], ids, weights, "situ", c.situ_beta, c.situ_linear_beta)
        r, _ = AddRmsNorm.raw_call(r, None, L["latent_norm"], c.rms_norm_eps)
        out = Linear.raw_call(r, L["up"])
        return out.add_(self._glu_mlp(x, L["shared_gu"], L["shared_down"]))

    def _attention(self, L, x, batch, step, pools, i):
        c = self.c
        gate = Linear.raw_call(x, L["g"])
        if L["kind"] == "kda":
            return layers.kda(L, x, gate, step, pools.conv[i], pools.recurrent[i], c)
        qa, _ = AddRmsNorm.raw_call(Linear.raw_call(x, L["q_a"]), None, L["q_a_norm"], layers.LOWRANK_EPS)
        q = Linear.raw_call(qa, L["q_b"]).view(-1, c.num_heads, c.qk_head_dim)
        o = layers.mla_attention(L, x, q, batch, step, pools.mla[i], c)
        return Linear.raw_call(SigmoidGate.raw_call(o, gate), L["o"])

    @torch.no_grad()
    def __call__(self, batch, pools) -> torch.Tensor:
        c = self.c
        eps = c.rms_norm_eps
        step = StepPlan(batch, pools.page_size)
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
            y = self._attention(L, xn, batch, step, pools, i)
            partial = y if partial is None else partial.add_(y)
            x = AttnResMix.raw_call(blocks[:nb], partial, L["mlp_mix"], eps)
            xn, _ = AddRmsNorm.raw_call(x, None, L["post_norm"], eps)
            partial = partial.add_(self._ffn(L, xn))
        h = AttnResMix.raw_call(blocks[:nb], partial, self.final_mix, eps).index_select(0, batch.logits_indices)
        h, _ = AddRmsNorm.raw_call(h, None, self.final_norm, eps)
        return LmHead.raw_call(h, self.head)


def build(model, config: ModelConfig) -> K3Target:
    return K3Target(model, config)
