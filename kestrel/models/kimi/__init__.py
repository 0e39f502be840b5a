"""Kimi Linear and Kimi K3."""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi.reference import KimiModel
from kestrel.models.kimi.weights import load_weights


def load_reference_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> KimiModel:
    """Build the reference model without allocating, then fill it from the checkpoint straight on `device`."""
    with torch.device("meta"):
        model = KimiModel(config)
    load_weights(model, path, config, dtype, device)
    return model.eval()
