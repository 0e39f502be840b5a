"""Kimi K3, bf16 weights, Hopper, one GPU.

The forward is the catalog's `_kimi_k3.K3Forward` (one per model: every sm_90 target of this model runs it); this
target chooses its routed-expert piece, `_layers.Bf16Experts`: bf16 stacks (docs/decode_launches.md).
"""

from __future__ import annotations

from kestrel.catalog import _layers as layers
from kestrel.catalog._kimi_k3 import K3Forward
from kestrel.config import ModelConfig


def build(model, config: ModelConfig) -> K3Forward:
    return K3Forward(model, config, layers.Bf16Experts)
