"""Deployment profile of the K3 Hopper target for NVFP4 routed experts and a bf16 trunk (the NVFP4 requantizations,
ModelOpt or compressed-tensors): what it claims of the engine's ModelingContext."""

CLAIM = {
    # K3's widths (the layer count is free: real-width checkpoints with few layers route here too)
    "shape fingerprint": {"arch": "kimi_k3", "hidden": 7168, "heads": 96, "q_lora": 1536, "kv_lora": 512,
                          "rope": 64, "kda_heads": 96, "kda_head_dim": 128, "experts": 896, "top_k": 16,
                          "latent": 3584, "act": "situ"},
    "arch": "sm_90",
    # the checkpoint's storage (routing.ModelingContext.weight_format): only the routed experts quantized
    "quant": "nvfp4 experts",
    "kv dtype": "bf16",
    "spec": ("none", "ngram", "dspark"),   # speculative verify with KDA replay (catalog/kda/verify_commit.py)
    "layout": "tp1",
}
