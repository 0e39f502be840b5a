"""A DSpark drafter folder's tensors: the name table, the checked loader, and the seeded random writer.

Names follow vLLM's K3 drafter checkpoints (no `model.` prefix; a leading `model.` is accepted):
`context_proj.weight`, `context_norm.weight`, `layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
`layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,
[g_proj],o_proj}.weight`, `layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight`, `final_norm.weight`,
`markov_head.markov_w{1,2}.weight` [V, rank], `confidence_head.proj.{weight,bias}` (when `enable_confidence_head`;
else skipped, as vLLM skips it). A copy of the target's `embed_tokens` / `lm_head` (or DeepSpec's
`mask_embedding`, `t2d`) is skipped: the drafter reads the target's own.
"""

from __future__ import annotations

import logging
import os

import torch

from kestrel.config import ModelConfig
from kestrel.errors import CheckpointError
from kestrel.models.kimi.weights import _check_shard, shard_files
from kestrel.spec.dspark import DSparkDrafter
from kestrel.spec.dspark_config import DSparkConfig

log = logging.getLogger("kestrel.spec")

SKIPPED = ("embed_tokens.", "lm_head.", "mask_embedding", "t2d", "d2t", "rotary_emb")


def expected_tensors(dc: DSparkConfig, target: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a drafter of `dc` holds."""
    model = _meta_drafter(dc, target)
    return {_ckpt_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def _meta_drafter(dc: DSparkConfig, target: ModelConfig) -> DSparkDrafter:
    with torch.device("meta"):
        return DSparkDrafter(dc, target)


def _ckpt_name(param: str) -> str:
    """A parameter's checkpoint name: norm vectors are bare parameters here, `.weight` in checkpoints."""
    return param if param.endswith((".weight", ".bias")) else param + ".weight"


def load_drafter(folder: str, dc: DSparkConfig, target: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> DSparkDrafter:
    """The drafter of `folder` on `device` in `dtype`; a missing, unknown or mis-shaped tensor is one
    CheckpointError naming it."""
    from safetensors import safe_open

    model = _meta_drafter(dc, target)
    params = {_ckpt_name(n): n for n, _ in model.named_parameters()}
    shapes = expected_tensors(dc, target)
    state: dict[str, torch.Tensor] = {}
    skipped = 0
    for fn in shard_files(folder):
        _check_shard(fn)
        with safe_open(fn, framework="pt") as f:
            for raw in f.keys():
                name = raw[len("model."):] if raw.startswith("model.") else raw
                if name not in shapes:
                    # vLLM drops the confidence head; a config that does not enable it may still ship its tensors
                    if any(s in name for s in SKIPPED) or name.startswith("confidence_head."):
                        skipped += 1
                        continue
                    raise CheckpointError(f"{fn}: tensor {raw} is not part of a DSpark drafter of this config "
                                          f"({dc.num_layers} draft layers); check the drafter's config.json")
                shape = tuple(f.get_slice(raw).get_shape())
                if shape != shapes[name]:
                    raise CheckpointError(f"{fn}: tensor {raw} has shape {list(shape)}, the drafter's config.json "
                                          f"implies {list(shapes[name])}; the checkpoint and config.json disagree")
                state[params[name]] = f.get_tensor(raw).to(device=device, dtype=dtype)
    missing = [n for n in shapes if params[n] not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: drafter tensor {missing[0]} is missing{more}; the checkpoint is incomplete "
                              "or was written for another config.json")
    if skipped:
        log.info("drafter: %d tensors skipped (copies of the target's embedding / LM head, training-only maps)",
                 skipped)
    model.load_state_dict(state, assign=True)
    return model.eval()


def init_drafter_(model: DSparkDrafter, seed: int) -> DSparkDrafter:
    """Trained-like seeded values in place (each tensor from (seed, name) alone): linear weights with variance
    1/fan_in, norm weights near 1, the Markov table and the confidence bias small."""
    from kestrel.models.kimi.checkpoint import weight_generator
    with torch.no_grad():
        for n, p in model.named_parameters():
            name = _ckpt_name(n)
            g = weight_generator(seed, "dspark." + name, p.device)
            if p.dim() == 1 and name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=g)
            elif p.dim() == 1:
                p.normal_(1.0, 0.05, generator=g)
            elif name.startswith("markov_head."):
                p.normal_(0.0, 0.1 / p.shape[1] ** 0.5, generator=g)
            else:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5, generator=g)
    return model


def random_drafter(dc: DSparkConfig, target: ModelConfig, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", seed: int = 0) -> DSparkDrafter:
    model = DSparkDrafter(dc, target).to(device=device, dtype=dtype)
    return init_drafter_(model, seed).eval()


def save_drafter(model: DSparkDrafter, folder: str) -> str:
    """config.json + model.safetensors (checkpoint names) into `folder`."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    model.dc.save(folder)
    tensors = {_ckpt_name(n): p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_random_drafter(folder: str, dc: DSparkConfig, target: ModelConfig, seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> str:
    """A seeded random (untrained) drafter folder for tests and demos."""
    return save_drafter(random_drafter(dc, target, dtype, "cpu", seed), folder)
