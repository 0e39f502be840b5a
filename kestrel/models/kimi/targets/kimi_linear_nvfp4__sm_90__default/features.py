"""Deployment profile of the Kimi Linear 48B Hopper target for NVFP4 routed experts (`kestrel quantize --format
nvfp4 --modules experts`: everything else bf16): what it claims of the engine's ModelingContext."""

CLAIM = {
    "shape fingerprint": {"arch": "kimi_linear", "hidden": 2304, "heads": 32, "q_lora": None, "kv_lora": 512,
                          "rope": 64, "kda_heads": 32, "kda_head_dim": 128, "experts": 256, "top_k": 8,
                          "latent": None, "act": "silu"},
    "arch": "sm_90",
    # the checkpoint's storage (routing.ModelingContext.weight_format): only the routed experts quantized
    "quant": "nvfp4 experts",
    "kv dtype": "bf16",
    "spec": ("none", "ngram", "dspark"),   # speculative verify with KDA replay (catalog/kda/verify_commit.py)
    "layout": "tp1",
}
