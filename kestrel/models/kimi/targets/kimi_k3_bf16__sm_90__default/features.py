"""Deployment profile of the K3 bf16 Hopper target: what it claims of the engine's ModelingContext."""

from kestrel.catalog._targets import claim

CLAIM = claim("kimi_k3", "bf16")

# Deployment profiles of this model over several ranks: the engine flags of each layout (kestrel/parallel/mapping.py
# names them; the name is the routing context's `layout`). This target claims tp1; the other layouts run the
# reference implementation over the ranks until a target claims them.
PROFILES = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "dep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "helix2": {"helix_size": 2},
    "helix2_moetp1ep2": {"helix_size": 2, "enable_expert_parallel": True, "moe_tp_size": 1},
    "tp4": {"tensor_parallel_size": 4},
    "dep4": {"data_parallel_size": 4, "enable_expert_parallel": True},
    "helix4": {"helix_size": 4},
    "helix4_moetp2ep2": {"helix_size": 4, "enable_expert_parallel": True, "moe_tp_size": 2},
    "tp8": {"tensor_parallel_size": 8},
    "dep8": {"data_parallel_size": 8, "enable_expert_parallel": True},
    "helix8": {"helix_size": 8},
    "helix8_moetp2ep4": {"helix_size": 8, "enable_expert_parallel": True, "moe_tp_size": 2},
    "tp16": {"tensor_parallel_size": 16},
    "dep16": {"data_parallel_size": 16, "enable_expert_parallel": True},
    "helix16": {"helix_size": 16},
    "helix16_moetp4ep4": {"helix_size": 16, "enable_expert_parallel": True, "moe_tp_size": 4},
}
