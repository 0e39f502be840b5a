"""What the sm_90 targets of one model share (models/kimi/targets/: a target never imports another, so it lives
in the catalog): their claim differs only in `quant`, the weights' storage.

Each `<model>_<fmt>__sm_90__default` folder keeps its own `features.py` (the router reads a claim per folder) and
`modeling.py`, built from here: the claim is the model's bf16 target's with `quant` set to `"<fmt> experts"` (only
the routed experts quantized, the trunk bf16), and the forward is the model's one with `_layers.W4A16Experts`,
whose W4A16 grouped GEMMs read MXFP4 and NVFP4 stacks alike (dequantized in the load path, bf16 math;
Kimi Linear's bf16 shared expert keeps its own GEMMs there, it cannot ride in the FP4 stacks as expert E).
"""

from __future__ import annotations

from itertools import combinations

FP4_FORMATS = ("mxfp4", "nvfp4")

# The widths each model's targets claim (the layer count is free: real-width checkpoints with few layers route
# here too).
FINGERPRINTS = {
    "kimi_k3": {"arch": "kimi_k3", "hidden": 7168, "heads": 96, "q_lora": 1536, "kv_lora": 512, "rope": 64,
                "kda_heads": 96, "kda_head_dim": 128, "experts": 896, "top_k": 16, "latent": 3584, "act": "situ"},
    "kimi_linear": {"arch": "kimi_linear", "hidden": 2304, "heads": 32, "q_lora": None, "kv_lora": 512, "rope": 64,
                    "kda_heads": 32, "kda_head_dim": 128, "experts": 256, "top_k": 8, "latent": None,
                    "act": "silu"},
}


# The MLA page formats the targets read (catalog/_layers.mla_attention: bf16 rows, FP8 / NVFP4 bytes), and every
# mix of them a per-layer override makes: the router's kv dtype is the layers' kinds, sorted, joined by '+'
# (llm.modeling_context). A "+kda-bf16" state (--kda-state-dtype bf16) is not among them: KdaDecode and the
# recurrent entries keep an fp32 state.
KV_KINDS = ("bf16", "fp8", "nvfp4")
KV_DTYPES = tuple("+".join(m) for n in range(1, len(KV_KINDS) + 1) for m in combinations(KV_KINDS, n))


def claim(model: str, quant: str) -> dict:
    """The sm_90, one-GPU claim of `model` ("kimi_k3" | "kimi_linear") for weights stored as `quant`
    (routing.ModelingContext.weight_format: "bf16", "mxfp4 experts", ...), over bf16, FP8 and NVFP4 MLA pages
    (any per-layer mix, `KV_DTYPES`); speculative verify with KDA replay
    (catalog/kda/verify_commit.py) for every weight format."""
    return {"shape fingerprint": dict(FINGERPRINTS[model]), "arch": "sm_90", "quant": quant, "kv dtype": KV_DTYPES,
            "spec": ("none", "ngram", "dspark"), "layout": "tp1"}


def fp4_experts_claim(model: str, fmt: str) -> dict:
    if fmt not in FP4_FORMATS:
        raise ValueError(f"FP4 expert targets read {FP4_FORMATS}, not {fmt!r}")
    return claim(model, f"{fmt} experts")


def build_fp4_experts(model: str):
    """The `modeling.build` of `model`'s FP4-expert targets."""
    from kestrel.catalog import _layers as layers
    if model == "kimi_k3":
        from kestrel.catalog._kimi_k3 import K3Forward as Forward
    else:
        from kestrel.catalog._kimi_linear import KimiLinearForward as Forward

    def build(reference, config):
        return Forward(reference, config, layers.W4A16Experts)
    return build
