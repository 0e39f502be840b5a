"""The Kimi K3 forward of the sm_90 targets, one GPU: one flat forward built only from catalog entries.

The targets (`models/kimi/targets/kimi_k3_*__sm_90__*`) differ in their claim and in the routed-expert piece they
pass (`_layers.Bf16Experts`, `_layers.W4A16Experts`: K3's checkpoints store the routed experts MXFP4 or NVFP4 and
everything else bf16); everything else runs here. Reads the same `StepBatch` and `CachePools` as the reference
implementation and returns the same logits (within the entries' bounds). K3's own pieces are here: attention
residuals (query vectors folded once as norm.weight * proj.weight; the residual add, the mix and the norm are one
AddMixRmsNorm, the FFN's output added by the next one), the q-LoRA query, the MLA and full-rank KDA output gates,
the latent MoE with SiTU (its down-projection and the shared experts' gate|up one GEMM on x, its up-projection and
the shared experts' down one GEMM on [normed latent | shared activation]). The layer pieces both targets run the
same way come from `catalog/_layers.py`; decode launch counts per layer are in docs/decode_launches.md.
"""

from __future__ import annotations

import torch

from kestrel.catalog import _layers as layers
from kestrel.catalog._step_plan import StepPlan
from kestrel.catalog.attention.output_gate import SigmoidGate
from kestrel.catalog.embedding.embed import Embedding
from kestrel.catalog.embedding.lm_head import LmHead
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.catalog.moe.combine_norm import MoeCombineRmsNorm
from kestrel.catalog.moe.glu import SituGlu
from kestrel.catalog.norm.add_mix_rmsnorm import AddMixRmsNorm
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.config import ModelConfig

param = layers.param


def _mix_query(model, name: str) -> torch.Tensor:
    """An attention-residual query vector: `<name>_norm.weight * <name>_proj.weight`, fp32."""
    return (param(model, name + "_norm").float() * param(model, name + "_proj").float().view(-1)).contiguous()


class K3Forward(layers.TargetForward):
    def __init__(self, model, config: ModelConfig, experts):
        self.final_mix = _mix_query(model, "output_attn_res")
        super().__init__(model, config, experts)

    def _layer(self, model, i: int) -> dict:
        c, p = self.c, f"layers.{i}."
        a = p + "self_attn."
        L = {**self.layer_weights(model, i), "attn_mix": _mix_query(model, p + "self_attention_res"),
             "mlp_mix": _mix_query(model, p + "mlp_res")}
        if L["kind"] == "kda":
            L.update(layers.kda_weights(model, a, "g_proj"), f_b=param(model, a + "f_b_proj.weight"))
        else:
            L.update(layers.mla_weights(model, a, c, "q_a_proj"), q_a_norm=param(model, a + "q_a_layernorm"),
                     q_b=param(model, a + "q_b_proj.weight"), g=param(model, a + "g_proj.weight"))
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            s = m + "shared_experts."
            L.update(x_in=layers.gemm_weight(model, [m + "routed_expert_down_proj.weight", s + "gate_proj.weight",
                                                     s + "up_proj.weight"]),
                     x_out=layers.gemm_weight(model, [m + "routed_expert_up_proj.weight", s + "down_proj.weight"],
                                              dim=1),
                     latent_norm=param(model, m + "routed_expert_norm") if c.latent_moe_use_norm else None)
        return L

    def _glu_mlp(self, x, gu_w, down_w):
        c = self.c
        return Linear.raw_call(SituGlu.raw_call(Linear.raw_call(x, gu_w), c.situ_beta, c.situ_linear_beta), down_w)

    def _ffn(self, L, x, step):
        """Latent MoE: z = routed_expert_down(x) and the shared gate|up from one GEMM; the combined, normalized
        latent and the shared SiTU land side by side in one buffer, projected back by one GEMM."""
        c = self.c
        if "dense_gu" in L:
            return self._glu_mlp(x, L["dense_gu"], L["dense_down"])
        ids, weights = layers.route(L, x, c)
        lat = c.routed_expert_hidden_size
        zs = layers.linear(x, L["x_in"])
        z, shared_gu = zs[:, :lat], zs[:, lat:]
        both = x.new_empty(x.shape[0], layers.in_width(L["x_out"]))
        r = both[:, :lat]
        if layers.small_moe(step, x.shape[0], c):
            y, w, slot_to_sorted = self.experts.small(L, z, ids, weights, c)
            if L["latent_norm"] is not None:
                MoeCombineRmsNorm.raw_call(y, w, slot_to_sorted, L["latent_norm"], c.rms_norm_eps, out=r)
            else:
                MoeCombine.raw_call(y, w, slot_to_sorted, out=r)
        else:
            routed = self.experts.routed(L, z, ids, weights, c, out=None if L["latent_norm"] is not None else r)
            if L["latent_norm"] is not None:
                AddRmsNorm.raw_call(routed, None, L["latent_norm"], c.rms_norm_eps, out=r)
        SituGlu.raw_call(shared_gu, c.situ_beta, c.situ_linear_beta, out=both[:, lat:])
        return layers.linear(both, L["x_out"])

    def _attention(self, L, x, batch, step, pools, i):
        c = self.c
        proj = Linear.raw_call(x, L["in"])
        if L["kind"] == "kda":
            mixed, low, b = layers.kda_inputs(proj, c)
            D = c.kda_head_dim
            f = Linear.raw_call(low[:, :D], L["f_b"])
            return layers.kda(L, mixed, f, b, low[:, D:], step, pools.conv[i], pools.recurrent[i], c,
                              self.replay_for(step, i))
        ql = c.q_lora_rank
        qa, _ = AddRmsNorm.raw_call(proj[:, :ql], None, L["q_a_norm"], layers.LOWRANK_EPS)
        q = Linear.raw_call(qa, L["q_b"]).view(-1, c.num_heads, c.qk_head_dim)
        o = layers.mla_attention(L, proj[:, ql:], q, batch, step, pools.mla[i], c, pools.page_format(i))
        # the gate has its own GEMM: SigmoidGate walks flat memory, a row view of the joined output would need a copy
        return Linear.raw_call(SigmoidGate.raw_call(o, Linear.raw_call(x, L["g"])), L["o"])

    @torch.no_grad()
    def __call__(self, batch, pools) -> torch.Tensor:
        c = self.c
        eps = c.rms_norm_eps
        step = StepPlan(batch, pools.page_size)
        self.begin_step(step)
        T, N = batch.token_ids.shape[0], c.hidden_size
        max_blocks = -(-c.num_layers // c.attn_res_block_size) + 1
        blocks = torch.empty(max_blocks, T, N, dtype=self.embed.dtype, device=self.embed.device)
        nb = 0
        partial = Embedding.raw_call(batch.token_ids, self.embed)
        delta = None      # the last FFN's output, added into the partial by the next AddMixRmsNorm
        for i, L in enumerate(self.layers):
            if i % c.attn_res_block_size == 0:
                # a new block starts: the partial (with the pending FFN output) is stored as block nb, and the
                # attention output starts the next partial
                xn, _ = AddMixRmsNorm.raw_call(delta, partial, blocks[:nb], L["attn_mix"], L["in_norm"], eps,
                                               r_out=blocks[nb])
                nb += 1
                partial = None
            else:
                xn, partial = AddMixRmsNorm.raw_call(delta, partial, blocks[:nb], L["attn_mix"], L["in_norm"], eps)
            y = self._attention(L, xn, batch, step, pools, i)
            if partial is None:
                xn, partial = AddMixRmsNorm.raw_call(None, y, blocks[:nb], L["mlp_mix"], L["post_norm"], eps)
            else:
                xn, partial = AddMixRmsNorm.raw_call(y, partial, blocks[:nb], L["mlp_mix"], L["post_norm"], eps)
            delta = self._ffn(L, xn, step)
            self.capture(i, partial, delta)
        h, _ = AddMixRmsNorm.raw_call(delta, partial, blocks[:nb], self.final_mix, self.final_norm, eps)
        return LmHead.raw_call(h.index_select(0, batch.logits_indices), self.head)

