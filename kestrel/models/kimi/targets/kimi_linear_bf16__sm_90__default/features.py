"""Deployment profile of the Kimi Linear 48B bf16 Hopper target: what it claims of the engine's ModelingContext."""

CLAIM = {
    "shape fingerprint": {"arch": "kimi_linear", "hidden": 2304, "heads": 32, "q_lora": None, "kv_lora": 512,
                          "rope": 64, "kda_heads": 32, "kda_head_dim": 128, "experts": 256, "top_k": 8,
                          "latent": None, "act": "silu"},
    "arch": "sm_90",
    "quant": "bf16",
    "kv dtype": "bf16",
    "spec": "none",
    "layout": "tp1",
}
