"""Layer pieces both Kimi targets run the same way, composed only of catalog entries.

Targets never import each other, so what they share lives here (underscore: not an entry; the entries it launches
are certified on their own). Each target keeps its own flat forward and passes in what differs: the KDA output
gate projection, the MLA query and output gate, the GLU activation.

Weights come from the loaded reference model, regrouped once for the kernels (docs/decode_launches.md): every
projection of one input joined into one GEMM (the fused kernels read strided row views of its output), conv
weights stacked, kv_b_proj split per head into W_UK and W_UV^T for the absorbed decode, and a shared expert of the
routed width stacked after the routed experts as expert E. Each joined tensor is allocated once and the model's
own parameters are re-pointed at slices of it (`_rebind`), so the originals are freed as the build goes: the
build's peak is one joined tensor over the weights (on Kimi Linear 48B one layer's experts, 3.6 GB), never a
second copy of the model. The reference model keeps computing the same values from those slices.

Decode steps (one token per request) run the fused entries: KdaDecode, MlaNormCacheWrite, and the small-batch
MoE (MoePermuteSmall, MoeGroupedGemmGlu); prefill and mixed steps keep the general entries.

The routed experts are a piece a target chooses by the checkpoint's storage (`Bf16Experts`, `W4A16Experts`): the
same three calls (`weights`, `small` for decode / verify steps, `routed` for prefill and mixed steps), so the
model forwards (`_kimi_linear.py`, `_kimi_k3.py`) are one per model and a quantized target differs from the bf16
one only in its claim and its expert piece.
"""

from __future__ import annotations

import torch

from kestrel.catalog._step_plan import MAX_VERIFY, decode_variant, decode_variants
from kestrel.catalog.attention.mla_cache_write_fp8 import MlaCacheWriteFp8
from kestrel.catalog.attention.mla_cache_write_nvfp4 import MlaCacheWriteNvfp4
from kestrel.catalog.attention.mla_decode import MlaDecode
from kestrel.catalog.attention.mla_decode_fp8 import MlaDecodeFp8
from kestrel.catalog.attention.mla_decode_nvfp4 import MlaDecodeNvfp4
from kestrel.catalog.attention.mla_gather import MlaGather
from kestrel.catalog.attention.mla_gather_dequant import MlaGatherDequant
from kestrel.catalog.attention.mla_norm_cache_write import MlaNormCacheWrite
from kestrel.catalog.attention.mla_prefill import MlaPrefill
from kestrel.catalog.gemm.head_bmm import HeadBmm
from kestrel.catalog.gemm.linear import Linear
from kestrel.catalog.kda.chunk import KdaChunkPrefill
from kestrel.catalog.kda.chunk_fla import KdaChunkFla
from kestrel.catalog.kda.conv import ShortConv
from kestrel.catalog.kda.decode import KdaDecode
from kestrel.catalog.kda.gate import KdaGate
from kestrel.catalog.kda.recurrent import KdaRecurrent
from kestrel.catalog.kda.verify_commit import KdaVerifyCommit
from kestrel.catalog.moe.grouped_gemm import MoeGroupedGemm
from kestrel.catalog.moe.combine import MoeCombine
from kestrel.catalog.moe.experts import MoeExperts
from kestrel.catalog.moe.grouped_gemm_glu import MoeGroupedGemmGlu
from kestrel.catalog.moe.permute import MoePermute
from kestrel.catalog.moe.permute_small import MoePermuteSmall
from kestrel.catalog.moe.router_bf16 import MoeRouterBf16
from kestrel.catalog.norm.add_rmsnorm import AddRmsNorm
from kestrel.catalog.norm.gated_rmsnorm import GatedRmsNorm
from kestrel.catalog.quant.fp8_linear import Fp8Linear
from kestrel.catalog.quant.fp8_quant_rows import Fp8QuantRows
from kestrel.catalog.quant.w4a16_grouped_gemm import W4A16GroupedGemm
from kestrel.catalog.quant.w4a16_grouped_gemm_glu import W4A16GroupedGemmGlu
from kestrel.kernels.moe.permute_small import MAX_SLOTS

LOWRANK_EPS = 1e-6     # q_a_layernorm / kv_a_layernorm


def param(model, name: str) -> torch.Tensor:
    return model.get_parameter(name).detach()


def _rebind(model, name: str, view: torch.Tensor) -> None:
    """Point the model's parameter `name` at `view`, a slice of a joined tensor with the same values, so that the
    parameter's own storage is freed (quantized weights are left as they are)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(getattr(mod, attr), torch.Tensor):
        setattr(mod, attr, torch.nn.Parameter(view, requires_grad=False))


def joined(model, names: list[str], dim: int = 0) -> torch.Tensor:
    """The parameters `names` concatenated along `dim` (0: the outputs of one GEMM; 1: its inputs), once."""
    parts = [param(model, n) for n in names]
    out = torch.cat(parts, dim).contiguous()
    offset = 0
    for n, p in zip(names, parts):
        _rebind(model, n, out.narrow(dim, offset, p.shape[dim]))
        offset += p.shape[dim]
    return out


def _stored(model, name: str):
    mod_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(mod_name) if mod_name else model, attr)


def is_fp8(model, name: str) -> bool:
    """Whether `name` is stored FP8 with a scale per output row (`--fp8-weight-read moe-mlp`,
    kestrel/models/kimi/fp8_read.py): a weight `linear` runs as W8A8."""
    w = _stored(model, name)
    return not isinstance(w, torch.Tensor) and w.format == "fp8" and w.granularity == "channel"


def gemm_weight(model, names: list[str], dim: int = 0):
    """`joined` for weights in the model dtype; for FP8 per-row ones (`is_fp8`) Fp8Linear's weight arguments
    {weight e4m3 [N, K], weight_scale fp32 [N, 1]} joined the same way (along the inputs, dim 1, the parts share
    each row's scale: fp8_read quantizes such a group together), the stored buffers re-pointed at slices."""
    if not any(is_fp8(model, n) for n in names):
        return joined(model, names, dim)
    if not all(is_fp8(model, n) for n in names):
        raise TypeError(f"{names}: one GEMM over FP8 and unquantized weights")
    parts = [_stored(model, n) for n in names]
    weight = torch.cat([p.values for p in parts], dim).contiguous()
    scale = parts[0].scale if dim == 1 else torch.cat([p.scale for p in parts], 0).contiguous()
    if dim == 1 and weight.device.type != "meta" and not all(torch.equal(p.scale, scale) for p in parts):
        raise ValueError(f"{names}: joined along the inputs, their FP8 rows need one scale each")
    offset = 0
    for p in parts:
        n = p.values.shape[dim]
        p.values = weight.narrow(dim, offset, n)
        if dim == 0:
            p.scale = scale.narrow(0, offset, n)
        offset += n
    return {"weight": weight, "weight_scale": scale}


def in_width(w) -> int:
    """K of a `gemm_weight`."""
    return (w["weight"] if isinstance(w, dict) else w).shape[1]


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T for a `gemm_weight`: Linear, or for FP8 weights per-token FP8 activations (Fp8QuantRows) into
    Fp8Linear, out in x's dtype."""
    if not isinstance(w, dict):
        return Linear.raw_call(x, w)
    xq, x_scale = Fp8QuantRows.raw_call(x)
    out = x.new_empty(x.shape[0], w["weight"].shape[0])
    return Fp8Linear.raw_call(xq, x_scale, w["weight"], w["weight_scale"], out=out)


def stacked_t(model, names: list[str]) -> torch.Tensor:
    """Linear weights [N, K] as one HeadBmm weight [len(names), K, N] (w[h] = W_h^T)."""
    out = torch.stack([param(model, n).t() for n in names]).contiguous()
    for h, n in enumerate(names):
        _rebind(model, n, out[h].t())
    return out


class TargetForward:
    """What the models' flat forwards share (catalog/_kimi_linear.py, catalog/_kimi_k3.py): the graph-capture
    surface, the embedding, head and final norm, and per layer its kind, norms and FFN weights (`layer_weights`);
    `experts` is the target's expert piece (Bf16Experts or W4A16Experts). A subclass's `_layer` adds its mixer."""
    # runtime/graphs.py may capture the decode step in CUDA graphs: no host sync, static shapes per bucket
    capturable = True
    decode_variant = staticmethod(decode_variant)
    decode_variants = staticmethod(decode_variants)

    # speculative decoding (kestrel/spec/): verify blocks (StepBatch.verify_segments) leave the KDA slots as they
    # were and keep what the replay needs; `commit_verify` advances the slots over the accepted tokens
    supports_verify = True
    # hidden-state capture for a drafter, as the reference model's: after each step `captured_hidden[l]` is the
    # [T, hidden] output of layer l (the residual stream after it; K3: its block's running sum) for every row
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model, config, experts):
        c = self.c = config
        self.experts = experts
        self.captured_hidden: dict[int, torch.Tensor] = {}
        self._replay: dict[int, dict] = {}       # KDA layer -> what verify_kda kept for the last step's blocks
        # KDA layer -> persistent buffers the replay tensors are copied into (`keep_replay`): a verify CUDA graph
        # writes them in place, so every verify graph shares one set instead of keeping its own in the pool
        self._replay_store: dict[int, dict] = {}
        self._verify_blocks = 0
        self.embed = param(model, "embed_tokens")
        self.head = self.embed if c.tie_word_embeddings else param(model, "lm_head")
        self.final_norm = param(model, "norm")
        self.layers = [self._layer(model, i) for i in range(c.num_layers)]

    def layer_weights(self, model, i: int) -> dict:
        c, p = self.c, f"layers.{i}."
        return {"kind": c.layer_kinds[i], "in_norm": param(model, p + "input_layernorm"),
                "post_norm": param(model, p + "post_attention_layernorm"),
                **ffn_weights(model, p, c.is_moe_layer(i), c, self.experts)}

    def _layer(self, model, i: int) -> dict:
        raise NotImplementedError(f"{type(self).__name__} builds its layers' mixer weights")

    # a DSpark drafter reads the target's embedding and LM head (DSparkProposer.share_target), as the reference's
    @property
    def embed_tokens(self) -> torch.Tensor:
        return self.embed

    def head_weight(self) -> torch.Tensor:
        return self.head

    def begin_step(self, step) -> None:
        """Per forward: forget the last step's captures and replay buffers."""
        self.captured_hidden = {}
        self._replay = {}
        self._verify_blocks = len(step.verify_segments)

    def replay_for(self, step, i: int) -> dict | None:
        """The replay buffer KDA layer i fills in a step with verify blocks (None in other steps)."""
        if step.kda_verify is None:
            return None
        return self._replay.setdefault(i, {"_store": self._replay_store.setdefault(i, {})})

    def graph_state(self) -> dict:
        """What a step leaves on the model for the runtime to read after it (the drafter's captured hidden states,
        the verify blocks' replay buffers). After a CUDA-graph capture these are tensors of the graph's pool that
        each replay rewrites; runtime/graphs.py keeps them per graph and `set_graph_state` points the model back at
        them after a replay (the last capture's would be another bucket's)."""
        return {"captured_hidden": dict(self.captured_hidden), "replay": dict(self._replay),
                "verify_blocks": self._verify_blocks}

    def set_graph_state(self, state: dict) -> None:
        self.captured_hidden = dict(state["captured_hidden"])
        self._replay = dict(state["replay"])
        self._verify_blocks = state["verify_blocks"]

    def capture(self, i: int, stream: torch.Tensor, pending: torch.Tensor) -> None:
        """Layer i's output (`stream` with the FFN output the next fused add would bring, `pending`) if a drafter
        reads it; nothing is computed for layers no one captures (the plain decode step's launches stay)."""
        if i in self.capture_layers:
            self.captured_hidden[i] = stream + pending

    @torch.no_grad()
    def commit_verify(self, accepted: list[int], pools) -> None:
        """After a step with verify blocks: `accepted[i]` (0..block length; the runtime passes a + 1 >= 1, and 0 for
        the padding blocks of a padded verify step) leading tokens of the i-th verify segment
        (StepBatch.verify_segments order) are kept; every KDA layer advances that request's conv and recurrent
        state over exactly those tokens (KdaVerifyCommit, one launch a layer). Call
        it once after such a step, before the next forward; MLA needs nothing (latents past the accepted tokens
        are never read, and later overwritten)."""
        if len(accepted) != self._verify_blocks:
            raise ValueError(f"{len(accepted)} accepted counts for {self._verify_blocks} verify blocks")
        if self._replay:
            dev = next(iter(self._replay.values()))["cu"].device
            n = torch.tensor(accepted, dtype=torch.int32).to(dev, non_blocking=True)
            for i, r in self._replay.items():
                commit_kda(r, n, pools.conv[i], pools.recurrent[i])
        self._replay = {}
        self._verify_blocks = 0


# ---- weights ---------------------------------------------------------------------------------------------------
def kda_weights(model, a: str, gate_in: str) -> dict:
    """The KDA weights (`a` = "layers.{i}.self_attn."). `in`: the projections of the layer input in one GEMM,
    [q; k; v; f_a; <gate_in>; b] (`gate_in` the output gate's first projection: Kimi Linear's g_a_proj, K3's
    full-rank g_proj); `kda_inputs` cuts its output back into views."""
    return {"in": joined(model, [a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", gate_in,
                                                             "b_proj")]),
            "conv": joined(model, [a + n for n in ("q_conv1d", "k_conv1d", "v_conv1d")]).squeeze(1),
            "A_log": param(model, a + "A_log").float().contiguous(),
            "dt_bias": param(model, a + "dt_bias").float().contiguous(),
            "o_norm": param(model, a + "o_norm").float().contiguous(),
            "o": param(model, a + "o_proj.weight")}


def mla_weights(model, a: str, c, q_in: str) -> dict:
    """The MLA weights: `in` = [<q_in>; kv_a_proj_with_mqa] (`q_in` Kimi Linear's q_proj, K3's q_a_proj), the
    per-head halves of kv_b_proj for the absorbed form; the rest of the query path and the output gate are the
    target's."""
    kv_b = param(model, a + "kv_b_proj.weight")
    per_head = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    return {"in": joined(model, [a + q_in + ".weight", a + "kv_a_proj_with_mqa.weight"]),
            "kv_norm": param(model, a + "kv_a_layernorm"), "kv_b": kv_b,
            "w_uk": per_head[:, :c.qk_nope_head_dim].contiguous(),                     # [H, nope, L]
            "w_uv_t": per_head[:, c.qk_nope_head_dim:].transpose(1, 2).contiguous(),   # [H, L, v]
            "o": param(model, a + "o_proj.weight")}


def _experts_with_shared(model, m: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E+1, 2I, H] and w2 [E+1, H, I] with the shared expert (gate rows, then up rows; down) as expert E:
    it runs inside the routed grouped GEMMs with weight 1.0 (MoePermuteSmall(shared=True)). The model's routed
    and shared parameters become slices of these, so each layer's old stacks are freed before the next is built."""
    w13, w2 = param(model, m + "experts.w13"), param(model, m + "experts.w2")
    E, I = w13.shape[0], w13.shape[1] // 2
    s = m + "shared_experts."
    big13, big2 = w13.new_empty((E + 1, *w13.shape[1:])), w2.new_empty((E + 1, *w2.shape[1:]))
    for big, small, name in ((big13, w13, "experts.w13"), (big2, w2, "experts.w2")):
        big[:E].copy_(small)
        _rebind(model, m + name, big[:E])
    for name, dst in (("gate_proj", big13[E, :I]), ("up_proj", big13[E, I:]), ("down_proj", big2[E])):
        dst.copy_(param(model, s + name + ".weight"))
        _rebind(model, s + name + ".weight", dst)
    return big13, big2


def ffn_weights(model, p: str, moe: bool, c, experts) -> dict:
    """Router, routed experts (through the `experts` piece) and shared experts of a MoE layer, or the dense GLU
    MLP (`p` = "layers.{i}.")."""
    if not moe:
        return {"dense_gu": joined(model, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                "dense_down": param(model, p + "mlp.down_proj.weight")}
    m = p + "block_sparse_moe."
    # the router GEMM reads the checkpoint's weight (MoeRouterBf16 accumulates in fp32): no fp32 copy
    L = {"router": param(model, m + "gate.weight"), "bias": param(model, m + "gate.e_score_correction_bias").float()}
    L.update(experts.weights(model, m, c))
    # a shared expert beside routed experts that cannot stack it, or a latent MoE's shared experts (on x, next to
    # the latent down-projection: the K3 forward joins those itself)
    if c.n_shared_experts and not c.routed_expert_hidden_size and not L["shared_expert"]:
        s = m + "shared_experts."
        L.update(shared_gu=gemm_weight(model, [s + "gate_proj.weight", s + "up_proj.weight"]),
                 shared_down=gemm_weight(model, [s + "down_proj.weight"]))
    return L


class Bf16Experts:
    """Routed experts stored in the model dtype: w13 [E, 2I, H], w2 [E, H, I]. Decode / verify: MoePermuteSmall,
    the GLU in the first grouped GEMM's epilogue, and a shared expert of the routed width (Kimi Linear's one)
    stacked as expert E; prefill: MoeExperts over the routed experts alone (views of the stacked weights)."""

    @staticmethod
    def weights(model, m: str, c) -> dict:
        """`w13` / `w2` what the small-batch path launches (with the shared expert as expert E when
        `shared_expert`), `w13_routed` / `w2_routed` the routed experts alone."""
        # a shared expert stored FP8 (--fp8-weight-read) cannot ride in the bf16 stacks: its own W8A8 GEMMs
        if c.n_shared_experts == 1 and not c.routed_expert_hidden_size and \
                not is_fp8(model, m + "shared_experts.gate_proj.weight"):
            w13, w2 = _experts_with_shared(model, m)
            E = c.num_experts
            return dict(w13=w13, w2=w2, w13_routed=w13[:E], w2_routed=w2[:E], shared_gu=w13[E], shared_down=w2[E],
                        shared_expert=True)
        w13, w2 = param(model, m + "experts.w13"), param(model, m + "experts.w2")
        return dict(w13=w13, w2=w2, w13_routed=w13, w2_routed=w2, shared_expert=False)

    @staticmethod
    def small(L: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, c):
        """(expert rows [S, N] in sorted order, their weights [T, k(+1)], slot_to_sorted) for MoeCombine(RmsNorm)."""
        perm, w = MoePermuteSmall.raw_call(ids, c.num_experts, weights, L["shared_expert"])
        h = MoeGroupedGemmGlu.raw_call(x, L["w13"], perm.expert_offsets, perm.sorted_token_ids, c.hidden_act,
                                       c.situ_beta, c.situ_linear_beta)
        return MoeGroupedGemm.raw_call(h, L["w2"], perm.expert_offsets), w, perm.slot_to_sorted

    @staticmethod
    def routed(L: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, c, out=None) -> torch.Tensor:
        """The routed experts' weighted sum [T, N] (no shared expert)."""
        return MoeExperts.raw_call(x, L["w13_routed"], L["w2_routed"], ids, weights, c.hidden_act, c.situ_beta,
                                   c.situ_linear_beta, out=out)


def quantized(model, name: str):
    """The `QuantizedWeight` the loader put at `name` (kestrel/quant/tensors.py: codes and scales as stored)."""
    mod_name, _, attr = name.rpartition(".")
    w = getattr(model.get_submodule(mod_name), attr)
    if isinstance(w, torch.Tensor):
        raise TypeError(f"{name} is a plain tensor: this target runs checkpoints whose routed experts are FP4")
    return w


def _fp4_args(w) -> dict:
    """W4A16GroupedGemm's weight arguments from a stacked FP4 `QuantizedWeight`."""
    if w.format not in ("mxfp4", "nvfp4"):
        raise TypeError(f"routed experts stored as {w.format}: the W4A16 experts read mxfp4 or nvfp4")
    return dict(packed=w.values, scale=w.scale, second=w.second, divisor=w.layout == "compressed-tensors")


class W4A16Experts:
    """Routed experts stored FP4 (MXFP4 / NVFP4, a stacked `QuantizedWeight` each for w13 and w2), run weight-only:
    W4A16GroupedGemmGlu (w13 gathering the tokens, the SiLU / SiTU GLU in its epilogue) -> W4A16GroupedGemm (w2),
    then the combine.
    Decode / verify permute with MoePermuteSmall, prefill with MoePermute. A shared expert cannot ride inside the
    FP4 stacks (it is stored bf16), so Kimi Linear's keeps its own GEMMs."""

    @staticmethod
    def weights(model, m: str, c) -> dict:
        return dict(w13=_fp4_args(quantized(model, m + "experts.w13")),
                    w2=_fp4_args(quantized(model, m + "experts.w2")), shared_expert=False)

    @staticmethod
    def _rows(L: dict, x: torch.Tensor, perm, c) -> torch.Tensor:
        h = W4A16GroupedGemmGlu.raw_call(x, expert_offsets=perm.expert_offsets,
                                         sorted_token_ids=perm.sorted_token_ids, act=c.hidden_act, beta=c.situ_beta,
                                         linear_beta=c.situ_linear_beta, **L["w13"])
        return W4A16GroupedGemm.raw_call(h, expert_offsets=perm.expert_offsets, **L["w2"])

    @staticmethod
    def small(L: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, c):
        perm, w = MoePermuteSmall.raw_call(ids, c.num_experts, weights, False)
        return W4A16Experts._rows(L, x, perm, c), w, perm.slot_to_sorted

    @staticmethod
    def routed(L: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, c, out=None) -> torch.Tensor:
        perm = MoePermute.raw_call(ids, c.num_experts)
        return MoeCombine.raw_call(W4A16Experts._rows(L, x, perm, c), weights, perm.slot_to_sorted, out=out)


# ---- compute ---------------------------------------------------------------------------------------------------
def route(L: dict, x: torch.Tensor, c):
    return MoeRouterBf16.raw_call(x, L["router"], L["bias"], c.num_experts_per_tok, c.n_group, c.topk_group,
                                  c.norm_topk_prob, c.routed_scaling_factor)


def small_moe(step, T: int, c) -> bool:
    """Whether the step's MoE runs the small-batch path (one-launch permute, GLU in the first GEMM's epilogue):
    decode and verify steps whose T*(k+1) slots fit MoePermuteSmall; prefill and mixed steps keep MoeExperts."""
    return step.max_len <= MAX_VERIFY and T * (c.num_experts_per_tok + 1) <= MAX_SLOTS


def kda_inputs(proj: torch.Tensor, c) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the joined KDA projection's output: (mixed [T, 3W] = q|k|v before the conv, low [T, D + G] =
    f_a x then the gate input (G = D low rank, W full rank), b [T, H])."""
    W, H = c.kda_width, c.kda_num_heads
    return proj[:, :3 * W], proj[:, 3 * W:proj.shape[1] - H], proj[:, proj.shape[1] - H:]


def kda(L: dict, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, step, conv_state,
        rec_state, c, replay: dict | None = None) -> torch.Tensor:
    """KDA then o_proj, from the projections of x (row views of one GEMM's output are fine): mixed [T, 3W],
    f [T, W] = f_b(f_a x), b [T, H], gate [T, W] the output gate's projection. A decode step is one KdaDecode
    (conv, gates, recurrence and gated norm); other steps run the segments in waves (see StepPlan), and the
    speculative verify blocks apart from them (`verify_kda`: the state slots are left as they were and what the
    replay needs goes into `replay`)."""
    H, D = c.kda_num_heads, c.kda_head_dim
    T = mixed.shape[0]
    if step.decode:
        y, _, _ = KdaDecode.raw_call(mixed, f, b, gate, L["conv"], conv_state, rec_state, step.kda_waves[0][2],
                                     L["A_log"], L["dt_bias"], L["o_norm"], c.rms_norm_eps, c.gate_lower_bound,
                                     step.pad_slot)
        return Linear.raw_call(y, L["o"])
    g, beta = KdaGate.raw_call(f, L["A_log"], L["dt_bias"], b, c.gate_lower_bound)
    o = torch.empty(T, H, D, dtype=mixed.dtype, device=mixed.device)
    if step.kda_verify is not None:
        verify_kda(L, mixed, g, beta, step.kda_verify, conv_state, rec_state, c, o, replay)
    for rows, cu, slots, snaps, fla_cu in step.kda_waves:
        part = mixed if rows is None else mixed.index_select(0, rows)
        # q, k, v as contiguous planes: fla-core's chunk_kda copies non-contiguous inputs (three copies a layer)
        qkv, _ = ShortConv.raw_call(part, L["conv"], conv_state, cu, slots, parts=3)
        q, k, v = (t.view(-1, H, D) for t in qkv)
        gw, bw = (g, beta) if rows is None else (g.index_select(0, rows), beta.index_select(0, rows))
        if step.max_len <= MAX_VERIFY:
            out, _ = KdaRecurrent.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
        else:
            # fla-core's chunked KDA where it runs (H200, 8K tokens x 32 heads: 1.99 ms against our 4.96 ms,
            # benchmarks/results/kda_prefill_h200.json), else ours: the same contract, both certified
            if KdaChunkFla.runs_on(q):
                out, _ = KdaChunkFla.raw_call(q, k, v, gw, bw, rec_state, cu, slots, fla_cu=fla_cu)
            else:
                out, _ = KdaChunkPrefill.raw_call(q, k, v, gw, bw, rec_state, cu, slots)
        if rows is None:
            o = out
        else:
            o.index_copy_(0, rows, out)
        for slot, snap in snaps:
            conv_state[snap].copy_(conv_state[slot])
            rec_state[snap].copy_(rec_state[slot])
    y = GatedRmsNorm.raw_call(o.view(-1, D), gate.reshape(-1, D), L["o_norm"], c.rms_norm_eps)
    return Linear.raw_call(y.view(T, -1), L["o"])


def verify_kda(L: dict, mixed, g, beta, verify, conv_state, rec_state, c, o, replay: dict | None) -> None:
    """The verify blocks' KDA outputs into their rows of o, computed from the states before the blocks and leaving
    the slots as they were: the conv runs on a copy of the blocks' conv states (3*W x (K-1) values a request) and
    the recurrence with update=False. `replay` gets what KdaVerifyCommit needs to advance the states over the
    accepted tokens: the blocks' conv inputs x, g, beta, the conv weight and the blocks' layout."""
    H, D = c.kda_num_heads, c.kda_head_dim
    rows, cu, slots, slots_long, local = verify
    if rows is None:            # every row of the step is a verify block's (StepPlan: a padded verify step)
        x, gv, bv = mixed.contiguous(), g, beta
    else:
        x, gv, bv = mixed.index_select(0, rows), g.index_select(0, rows), beta.index_select(0, rows)
    qkv, _ = ShortConv.raw_call(x, L["conv"], conv_state.index_select(0, slots_long), cu, local, parts=3)
    q, k, v = (t.view(-1, H, D) for t in qkv)
    out, _ = KdaRecurrent.raw_call(q, k, v, gv, bv, rec_state, cu, slots, update=False)
    if rows is None:
        o.copy_(out)
    else:
        o.index_copy_(0, rows, out)
    if replay is not None:
        keep_replay(replay, x=x, g=gv, beta=bv, slots=slots)
        replay.update(weight=L["conv"], cu=cu)


def keep_replay(replay: dict, **tensors: torch.Tensor) -> None:
    """Copy `tensors` into the layer's persistent replay buffers (`replay["_store"]`, grown when too small: the
    largest verify bucket runs eagerly before its capture, so a capture never grows them) and keep views of them."""
    store = replay["_store"]
    for name, t in tensors.items():
        buf = store.get(name)
        if buf is None or buf.shape[0] < t.shape[0] or buf.shape[1:] != t.shape[1:] or buf.dtype != t.dtype:
            buf = store[name] = torch.empty_like(t)
        view = buf[:t.shape[0]]
        view.copy_(t)
        replay[name] = view


def commit_kda(replay: dict, accepted: torch.Tensor, conv_state, rec_state) -> None:
    """After a verify step: advance each verify block's KDA states over its first accepted[b] tokens (int32 [B] on
    the device) from what `verify_kda` kept."""
    r = replay
    KdaVerifyCommit.raw_call(r["x"], r["weight"], r["g"], r["beta"], conv_state, rec_state, r["cu"], r["slots"],
                             accepted)


def kv_kind(fmt) -> str | None:
    """The quantized kind ("fp8" | "nvfp4") of a layer's page format (CachePools.page_format), None for plain rows."""
    return fmt.kind if fmt is not None and fmt.quantized else None


def mla_attention(L: dict, kv: torch.Tensor, q: torch.Tensor, batch, step, pages, c, fmt=None) -> torch.Tensor:
    """Write the kv_a rows kv [T, L + R] (normalized latent | k_pe) into the pages and attend with q [T, H,
    nope + rope]: the absorbed form over the latent when every segment is short (decode, verify), else the
    expanded form. `fmt`: the layer's page format (`--kv-cache-dtype` / `--kv-cache-dtype-layers`): plain rows
    take the fused norm + write; FP8 / NVFP4 pages take the latent normalized first (the quantized writes encode
    a finished latent), decode reads them directly and prefill reads dequantized context rows. Returns
    [T, H * v] before o_proj."""
    H, Lr = c.num_heads, c.kv_lora_rank
    T = q.shape[0]
    kind = kv_kind(fmt)
    if kind is None:
        MlaNormCacheWrite.raw_call(kv, L["kv_norm"], LOWRANK_EPS, pages, batch.block_tables, step.req_idx,
                                   batch.positions)
    else:
        latent, _ = AddRmsNorm.raw_call(kv[:, :Lr], None, L["kv_norm"], LOWRANK_EPS)
        if kind == "fp8":
            MlaCacheWriteFp8.raw_call(latent, kv[:, Lr:], pages, batch.block_tables, step.req_idx, batch.positions)
        else:
            MlaCacheWriteNvfp4.raw_call(latent, kv[:, Lr:], pages, batch.block_tables, step.req_idx,
                                        batch.positions)
    if step.max_len <= MAX_VERIFY:
        o = _mla_absorbed(L, q, pages, batch.block_tables, step.req_idx, step.kv_lens, step.num_splits, c, kind)
    elif step.mla_split is None:
        o = _mla_expanded(L, q, pages, step.ctx_rows, step.cu_q, step.cu_k, c, kind)
    else:   # a mixed step: short segments absorbed, long ones expanded over their own context only
        short, long = step.mla_split
        o = q.new_empty(T, H, c.v_head_dim)
        o.index_copy_(0, short, _mla_absorbed(L, q.index_select(0, short), pages, batch.block_tables,
                                              step.req_idx.index_select(0, short),
                                              step.kv_lens.index_select(0, short), step.num_splits, c, kind))
        o.index_copy_(0, long, _mla_expanded(L, q.index_select(0, long), pages, step.ctx_rows, step.cu_q_long,
                                             step.cu_k, c, kind))
    return o.reshape(T, -1).contiguous()


def _mla_absorbed(L: dict, q, pages, block_tables, req_idx, kv_lens, num_splits: int, c,
                  kind: str | None = None) -> torch.Tensor:
    """Attention over the cached latents: q_nope absorbed into the latent space, values back through w_uv; the
    quantized pages of `kind` dequantized in the decode kernel's load path."""
    q_abs = torch.cat([HeadBmm.raw_call(q[..., :c.qk_nope_head_dim], L["w_uk"]),
                       q[..., c.qk_nope_head_dim:]], dim=-1).contiguous()
    args = (q_abs, pages, block_tables, req_idx, kv_lens, c.softmax_scale, c.kv_lora_rank, num_splits)
    if kind is None:
        o_lat, _ = MlaDecode.raw_call(*args)
    elif kind == "fp8":
        o_lat, _ = MlaDecodeFp8.raw_call(*args)
    else:
        o_lat, _ = MlaDecodeNvfp4.raw_call(*args)
    return HeadBmm.raw_call(o_lat, L["w_uv_t"])


def _mla_expanded(L: dict, q, pages, ctx_rows, cu_q, cu_k, c, kind: str | None = None) -> torch.Tensor:
    """Attention with every context latent expanded to per-head keys and values (prefill segments); quantized
    pages of `kind` are read as dequantized rows in q's dtype (MlaGatherDequant)."""
    H, Lr = c.num_heads, c.kv_lora_rank
    if kind is None:
        ctx = MlaGather.raw_call(pages, ctx_rows)
    else:
        ctx = MlaGatherDequant.raw_call(pages, ctx_rows, kind, Lr, c.qk_rope_head_dim, q.dtype)
    dn = c.qk_nope_head_dim
    kvb = Linear.raw_call(ctx[:, :Lr].contiguous(), L["kv_b"]).view(-1, H, dn + c.v_head_dim)
    k_nope, v, k_pe = kvb[..., :dn], kvb[..., dn:], ctx[:, Lr:]
    if dn == 1 << (c.qk_head_dim.bit_length() - 1):
        # k_nope and v stay strided views of kv_b's output and k_pe is read once for all heads (the kernel's
        # power-of-two part of the score dot is k_nope): at an 8K prompt the per-head [k_nope | k_pe] copy and the
        # v copy wrote 200 MB a layer
        return MlaPrefill.raw_call(q.contiguous(), k_nope, v, cu_q, cu_k, c.softmax_scale, k_rope=k_pe)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)
    return MlaPrefill.raw_call(q.contiguous(), k, v, cu_q, cu_k, c.softmax_scale)
