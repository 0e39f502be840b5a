"""Kimi Linear 48B with NVFP4 routed experts (everything else bf16), Hopper, one GPU.

The forward is the catalog's `_kimi_linear.KimiLinearForward` (one per model: every sm_90 target of this model runs
it); this target chooses its routed-expert piece, `_layers.W4A16Experts`: the FP4 stacks run weight-only
(W4A16GroupedGemm: dequantized in the GEMM's load path, bf16 math); the bf16 shared expert keeps its own GEMMs.
"""

from __future__ import annotations

from kestrel.catalog import _layers as layers
from kestrel.catalog._kimi_linear import KimiLinearForward
from kestrel.config import ModelConfig


def build(model, config: ModelConfig) -> KimiLinearForward:
    return KimiLinearForward(model, config, layers.W4A16Experts)
