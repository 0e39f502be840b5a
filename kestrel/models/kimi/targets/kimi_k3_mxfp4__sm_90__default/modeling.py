"""Kimi K3 with MXFP4 routed experts (Moonshot's checkpoint: everything else bf16), Hopper, one GPU.

The forward is the catalog's `_kimi_k3.K3Forward` (one per model: every sm_90 target of this model runs it); this
target chooses its routed-expert piece, `_layers.W4A16Experts`: the FP4 stacks run weight-only (W4A16GroupedGemm:
dequantized in the GEMM's load path, bf16 math).
"""

from __future__ import annotations

from kestrel.catalog import _layers as layers
from kestrel.catalog._kimi_k3 import K3Forward
from kestrel.config import ModelConfig


def build(model, config: ModelConfig) -> K3Forward:
    return K3Forward(model, config, layers.W4A16Experts)
