"""The Kimi Linear 48B forward of the sm_90 targets, one GPU: one flat forward built only from catalog entries.

The targets (`models/kimi/targets/kimi_linear_*__sm_90__*`) differ in their claim and in the routed-expert piece
they pass (`_layers.Bf16Experts`, `_layers.W4A16Experts`); everything else runs here. Next to K3: a plain residual
stream with fused add + RMSNorm, MLA with a full q_proj and no output gate, KDA with the softplus forget gate and
the low-rank output gate, SiLU experts on the hidden state with one shared expert. The layer pieces both targets run
the same way come from `catalog/_layers.py`. A decode step launches 12 kernels per KDA + MoE layer and 15 per MLA +
MoE layer (docs/decode_launches.md): each layer input's projections are one GEMM, f_b and g_b one batched GEMM over
the two low-rank halves, KDA one kernel, and the shared expert rides in the routed experts' grouped GEMMs as expert
E (bf16 experts; beside FP4 experts it keeps its own three launches).
"""

from __future__ import annotations

import torch

from kestrel.catalog import _layers as layers
from kestrel.catalog._step_plan import StepPlan
from kestrel.catalog.embedding.embed import Embedding
from kestrel.catalog.embedding.lm_head import LmHead
from kestrel.catalog.gemm.head_bmm import HeadBmm
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.catalog.moe.glu import SiluGlu
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm


class KimiLinearForward(layers.TargetForward):
    def _layer(self, model, i: int) -> dict:
        c, a = self.c, f"layers.{i}.self_attn."
        L = self.layer_weights(model, i)
        if L["kind"] == "kda":
            L.update(layers.kda_weights(model, a, "g_a_proj"),
                     fg_b=layers.stacked_t(model, [a + "f_b_proj.weight", a + "g_b_proj.weight"]))
        else:
            L.update(layers.mla_weights(model, a, c, "q_proj"))
        return L

    def _glu_mlp(self, x, gu_w, down_w):
        return layers.linear(SiluGlu.raw_call(layers.linear(x, gu_w)), down_w)

    def _ffn(self, L, x, step):
        if "dense_gu" in L:
            return self._glu_mlp(x, L["dense_gu"], L["dense_down"])
        c = self.c
        ids, weights = layers.route(L, x, c)
        stacked = False     # whether the shared expert ran inside the routed GEMMs (as expert E)
        if layers.small_moe(step, x.shape[0], c):
            out = MoeCombine.raw_call(*self.experts.small(L, x, ids, weights, c))
            stacked = L["shared_expert"]
        else:
            out = self.experts.routed(L, x, ids, weights, c)
        if "shared_gu" in L and not stacked:
            out.add_(self._glu_mlp(x, L["shared_gu"], L["shared_down"]))
        return out

    def _attention(self, L, x, batch, step, pools, i):
        c = self.c
        proj = Linear.raw_call(x, L["in"])
        if L["kind"] == "kda":
            mixed, low, b = layers.kda_inputs(proj, c)
            fg = HeadBmm.raw_call(low.view(-1, 2, c.kda_head_dim), L["fg_b"])     # [T, 2, W]: f, then the gate
            return layers.kda(L, mixed, fg[:, 0], b, fg[:, 1], step, pools.conv[i], pools.recurrent[i], c,
                              self.replay_for(step, i))
        nq = c.num_heads * c.qk_head_dim
        q = proj[:, :nq].view(-1, c.num_heads, c.qk_head_dim)
        return Linear.raw_call(layers.mla_attention(L, proj[:, nq:], q, batch, step, pools.mla[i], c,
                                                  pools.page_format(i)), L["o"])

    @torch.no_grad()
    def __call__(self, batch, pools) -> torch.Tensor:
        eps = self.c.rms_norm_eps
        step = StepPlan(batch, pools.page_size)
        self.begin_step(step)
        h = Embedding.raw_call(batch.token_ids, self.embed)
        delta = None   # the last sublayer's output, added into h by the next fused add + norm
        for i, L in enumerate(self.layers):
            xn, h = AddRmsNorm.raw_call(delta, h, L["in_norm"], eps) if delta is not None else \
                AddRmsNorm.raw_call(h, None, L["in_norm"], eps)
            delta = self._attention(L, xn, batch, step, pools, i)
            xn, h = AddRmsNorm.raw_call(delta, h, L["post_norm"], eps)
            delta = self._ffn(L, xn, step)
            self.capture(i, h, delta)
        rows = batch.logits_indices
        h, _ = AddRmsNorm.raw_call(delta.index_select(0, rows), h.index_select(0, rows), self.final_norm, eps)
        return LmHead.raw_call(h, self.head)

