"""Kimi Linear and Kimi K3."""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi.reference import KimiModel
from kestrel.models.kimi.weights import load_weights


def load_reference_model(path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                         mapping=None) -> KimiModel:
    """Build the reference model without allocating, then fill it from the checkpoint straight on `device`
    (`mapping`: one rank's part, and only that part of each tensor is read)."""
    with torch.device("meta"):
        model = KimiModel(config, mapping)
    load_weights(model, path, config, dtype, device, mapping)
    return model.eval()
