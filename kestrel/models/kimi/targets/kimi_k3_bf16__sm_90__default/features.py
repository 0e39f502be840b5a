"""Deployment profile of the K3 bf16 Hopper target: what it claims of the engine's ModelingContext."""

CLAIM = {
    # K3's widths (the layer count is free: real-width checkpoints with few layers route here too)
    "shape fingerprint": {"arch": "kimi_k3", "hidden": 7168, "heads": 96, "q_lora": 1536, "kv_lora": 512,
                          "rope": 64, "kda_heads": 96, "kda_head_dim": 128, "experts": 896, "top_k": 16,
                          "latent": 3584, "act": "situ"},
    "arch": "sm_90",
    "quant": "bf16",
    "kv dtype": "bf16",
    "spec": "none",
    "layout": "tp1",          # the parallel issue adds tp / dep / helix profiles
}
