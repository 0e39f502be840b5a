"""Kimi Linear 48B, bf16 weights, Hopper, one GPU.

The forward is the catalog's `_kimi_linear.KimiLinearForward` (one per model: every sm_90 target of this model runs
it); this target chooses its routed-expert piece, `_layers.Bf16Experts`: bf16 stacks, with the shared expert stacked
after the routed ones as expert E on decode steps (docs/decode_launches.md).
"""

from __future__ import annotations

from kestrel.catalog import _layers as layers
from kestrel.catalog._kimi_linear import KimiLinearForward
from kestrel.config import ModelConfig


def build(model, config: ModelConfig) -> KimiLinearForward:
    return KimiLinearForward(model, config, layers.Bf16Experts)
