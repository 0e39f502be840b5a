"""`--fp8-weight-read moe-mlp`: the bf16 MoE-block MLP projections stored FP8 e4m3 at load (lossy, opt-in).

What is converted, per MoE layer: the shared experts' gate / up / down projections and, on a latent MoE (K3), the
latent down / up projections (`routed_expert_down_proj`, `routed_expert_up_proj`). Each becomes a `QuantizedWeight`
of format fp8, granularity channel (one fp32 scale per output row: `quant.formats.quantize_fp8`), so

- the reference reads it through `reference.weight()`, which dequantizes on the fly (weight-only, any device), and
- the sm_90 targets run it as W8A8 (`catalog/quant/fp8_quant_rows.py` per-token activations, then
  `catalog/quant/fp8_linear.py`), through `catalog/_layers.linear`.

The K3 target joins `routed_expert_up_proj` and the shared experts' `down_proj` along their inputs into one GEMM
([latent | shared activation] -> hidden), which one scale per output row must cover: those two are quantized
together, each row's scale taken over both, so the joined weight is the two stored ones side by side. Weights the
checkpoint already stores quantized are left as they are. The error: e4m3 keeps 3 mantissa bits, so round to
nearest moves each weight by at most 2^-4 of its magnitude (subnormals below 2^-6 x the row's scale, absolutely by
at most 2^-10 x that scale); the tests bound the logits by that.
"""

from __future__ import annotations

import logging

import torch

from kestrel.config import FP8_WEIGHT_READS, ModelConfig
from kestrel.quant.formats import quantize_fp8
from kestrel.quant.tensors import QuantizedWeight

log = logging.getLogger("kestrel")


def moe_mlp_groups(config: ModelConfig) -> list[list[str]]:
    """The parameter names `moe-mlp` converts, in groups quantized together (a group of several: one weight split
    along its inputs, the rows' scales shared; see the module doc)."""
    groups = []
    if not config.n_shared_experts and not config.routed_expert_hidden_size:
        return groups
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        m = f"layers.{i}.block_sparse_moe."
        s = m + "shared_experts."
        shared = [s + "gate_proj.weight", s + "up_proj.weight"] if config.n_shared_experts else []
        down = [s + "down_proj.weight"] if config.n_shared_experts else []
        if config.routed_expert_hidden_size:
            groups += [[m + "routed_expert_down_proj.weight"], *([n] for n in shared),
                       [m + "routed_expert_up_proj.weight", *down]]
        else:
            groups += [*([n] for n in shared), down]
    return groups


def _owner(model, name: str):
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def fp8_weights(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(e4m3 values, fp32 scale [N, 1]) of each weight [N, K_j] of one group: quantized as their concatenation
    along K, per output row."""
    values, scale = quantize_fp8(torch.cat([w.float() for w in weights], 1), "channel")
    return [(v, scale) for v in values.split([w.shape[1] for w in weights], 1)]


def convert_fp8_weight_read(model, config: ModelConfig, mode: str) -> tuple[int, int]:
    """Replace the projections `mode` names with FP8 `QuantizedWeight`s, in place; (how many, bytes saved).
    One group at a time, so the peak is one group's fp32 copy."""
    if mode not in FP8_WEIGHT_READS:
        raise ValueError(f"fp8 weight read {mode!r}: use one of {', '.join(FP8_WEIGHT_READS)}")
    if mode == "none":
        return 0, 0
    count = saved = 0
    for group in moe_mlp_groups(config):
        owners = [_owner(model, n) for n in group]
        weights = [getattr(mod, attr) for mod, attr in owners]
        if not all(isinstance(w, torch.Tensor) for w in weights):
            continue            # stored quantized by the checkpoint already
        with torch.no_grad():
            encoded = fp8_weights([w.detach() for w in weights])
        for (mod, attr), w, (values, scale) in zip(owners, weights, encoded):
            q = QuantizedWeight("compressed-tensors", "fp8", "channel", tuple(w.shape), w.dtype, w.device)
            q.fill("values", values)
            q.fill("scale", scale)
            saved += w.numel() * w.element_size() - sum(b.numel() * b.element_size() for b in q.buffers())
            delattr(mod, attr)
            mod.add_module(attr, q)
            count += 1
    return count, saved


def apply_fp8_weight_read(model, config: ModelConfig, mode: str) -> None:
    """`convert_fp8_weight_read` with its log line (the engine's load)."""
    count, saved = convert_fp8_weight_read(model, config, mode)
    if mode != "none":
        what = "shared experts" + (" and latent MoE projections" if config.routed_expert_hidden_size else "")
        log.info("--fp8-weight-read %s: %d projections (%s) stored FP8 e4m3 per output channel, %.1f MiB saved",
                 mode, count, what, saved / 2 ** 20)

