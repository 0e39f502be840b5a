"""Seeded random checkpoints in Moonshot's layout, at tiny or real widths (`kestrel make-checkpoint`).

The weights have trained-like scales so that what runs on them behaves like a trained model: linear weights with
variance 1/fan_in, norm weights near 1, routers that spread tokens over most experts, KDA decays in a trained
range. Each tensor's values depend only on (seed, tensor name), so `--layers 4` and `--layers 8` share layers.
Shards are written one layer at a time, so real widths never need the whole model in memory.
`random_reference_model` draws the same tensors in place on any device (`--load-format random`), and
`make_checkpoint(config_only=True)` writes the folder it needs: config.json and the tokenizer, no weights.
"""

from __future__ import annotations

import copy
import json
import os
import zlib

import torch

from kestrel.config import ModelConfig
from kestrel.models.kimi.reference import KimiModel
from kestrel.models.kimi.weights import (FP32_PARAMS, checkpoint_name, expected_tensors, init_weights,
                                         quantized_linears)
from kestrel.quant.tensors import encode

KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8,
    "num_shared_experts": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "model_max_length": 1048576, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
    "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "kda_layers": []},
}

K3_TEXT = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792,
    "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True, "moe_intermediate_size": 3072, "num_experts": 896,
    "num_experts_per_token": 16, "num_shared_experts": 2, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "attn_res_block_size": 12,
    "model_max_length": 1048576, "tie_word_embeddings": False,
    "linear_attn_config": {"head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True,
                           "full_attn_layers": list(range(4, 93, 4)) + [93], "kda_layers": []},
}

KIMI_LINEAR_TINY = {
    **KIMI_LINEAR_48B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_token": 2, "model_max_length": 4096,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                           "full_attn_layers": [2, 4], "kda_layers": []},
}

K3_TINY_TEXT = {
    **K3_TEXT, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "routed_expert_hidden_size": 32,
    "attn_res_block_size": 2, "model_max_length": 4096,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True, "full_attn_layers": [3, 6], "kda_layers": []},
}

PRESETS = {"kimi-linear-48b": KIMI_LINEAR_48B, "k3": K3_TEXT, "kimi-linear-tiny": KIMI_LINEAR_TINY,
           "k3-tiny": K3_TINY_TEXT}


def preset_config(preset: str, layers: int | None = None) -> dict:
    """config.json for a preset, optionally cut to `layers` layers with the same MLA / KDA rhythm (every fourth
    layer and the last are MLA, as in both real models)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    text = copy.deepcopy(PRESETS[preset])
    n = text["num_hidden_layers"] if layers is None else layers
    lin = text["linear_attn_config"]
    if layers is not None:
        every = 4 if n >= 4 else 2
        full = sorted({i for i in range(every, n + 1, every)} | {n})
        lin["full_attn_layers"] = full
    text["num_hidden_layers"] = n
    lin["kda_layers"] = [i for i in range(1, n + 1) if i not in lin["full_attn_layers"]]
    if preset.startswith("k3"):
        return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
                "text_config": text, "tie_word_embeddings": False,
                **{k: text.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text}}
    return text


def weight_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of one checkpoint tensor: seeded by (seed, name) alone, on `device`. CPU and CUDA generators
    draw different values from the same seed, so the same seed gives the same weights per device type only (and on
    CUDA per GPU model: torch spreads a draw over a grid sized by the SM count)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))


def init_tensor_(name: str, out: torch.Tensor, c: ModelConfig, seed: int) -> torch.Tensor:
    """Write trained-like values for checkpoint tensor `name` into `out` (in the checkpoint's shape) in place, on
    out's device and in out's dtype. `make-checkpoint` and `--load-format random` both draw every tensor here."""
    g = weight_generator(seed, name, out.device)
    shape = out.shape
    if name.endswith("A_log"):
        # decay rates: Kimi Linear's softplus gate wants A in [1, 16]; K3's bounded gate is steeper per unit of A
        lo, hi = (1.0, 16.0) if c.gate_lower_bound is None else (0.5, 2.0)
        return out.uniform_(lo, hi, generator=g).log_()
    if name.endswith("dt_bias"):
        # put exp(g) in a trained range (mostly 0.6 .. 0.99 per token)
        lo, hi = (-5.0, -2.0) if c.gate_lower_bound is None else (-4.0, -1.0)
        return out.uniform_(lo, hi, generator=g)
    if name.endswith("e_score_correction_bias"):
        return out.normal_(0.0, 0.02, generator=g)
    if "conv1d" in name:
        return out.normal_(0.0, 0.5, generator=g)
    if name.endswith("norm.weight"):
        return out.normal_(1.0, 0.05, generator=g)
    if name.startswith("embed_tokens"):
        return out.normal_(0.0, 1.0, generator=g)
    if "_res_proj" in name:
        return out.normal_(0.0, 1.0 / shape[-1] ** 0.5, generator=g)
    if len(shape) == 2:
        return out.normal_(0.0, 1.0 / shape[1] ** 0.5, generator=g)
    raise ValueError(f"no init rule for {name}")


def tensor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Decay and routing constants stay fp32 in every checkpoint and model; the rest is `dtype`."""
    return torch.float32 if FP32_PARAMS.search(name) else dtype


def random_reference_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                           seed: int = 0, mapping=None) -> KimiModel:
    """The reference model with the weights `make_checkpoint(seed=seed)` would write, drawn in place on `device`
    in `dtype` (`--load-format random`): no checkpoint tensors are read. On the CPU they equal the checkpoint's
    exactly (same generator, same dtype); on a GPU they are drawn by the GPU's generator (other values, same
    statistics). `mapping`: one rank's part of those weights (kestrel/parallel/shard.py)."""
    with torch.device("meta"):
        model = KimiModel(config, mapping)
    init_weights(model, config, dtype, device, lambda name, out: init_tensor_(name, out, config, seed), mapping)
    return model.eval()


def _file_mode(folder: str) -> int:
    """The mode an ordinary new file gets in `folder` (0o666 less the umask), read off a probe file rather than by
    flipping the process-wide umask. safetensors writes its shards 0o600, so make_checkpoint sets every file it
    writes to this one mode."""
    probe = os.path.join(folder, f".mode-probe-{os.getpid()}")
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.unlink(probe)


def make_checkpoint(preset: str, out: str, layers: int | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, with_tokenizer: bool = True, progress=None,
                    config_only: bool = False, quant: str | None = None,
                    quant_layout: str = "compressed-tensors", config: dict | None = None,
                    weights: KimiModel | None = None) -> str:
    """Write config.json, safetensors shards (one per layer) with an index, and a demo tokenizer to `out`.
    `config_only`: config.json and the tokenizer alone, a folder for `--load-format random` (a real-width model
    without writing its weights). `quant`: the routed experts stored in that format (`quant_layout`), the rest in
    `dtype`: the `quantization_config` and tensors `kestrel quantize --modules experts` writes from the same
    weights. `config`: this config.json (a preset's, edited) instead of the preset's; `weights`: a model of that
    config (e.g. one trained in fp32) whose parameters are written instead of seeded random values."""
    from safetensors.torch import save_file

    from kestrel.quant.quantize import config_quantization
    raw = copy.deepcopy(config) if config is not None else preset_config(preset, layers)
    if quant is not None:
        raw["quantization_config"] = config_quantization(ModelConfig.from_dict(raw), quant, "experts", quant_layout)
    os.makedirs(out, exist_ok=True)
    mode = _file_mode(out)
    written: list[str] = []
    text = raw.get("text_config", raw)
    if with_tokenizer:
        from kestrel.tokenizer import load_tokenizer, write_demo_tokenizer
        if text["vocab_size"] <= 4096:
            before = set(os.listdir(out))
            write_demo_tokenizer(out, text["vocab_size"])
            written += sorted(set(os.listdir(out)) - before)
            tok = load_tokenizer(out)
            ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
            raw.update(ids)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    written.append("config.json")
    if not config_only:
        written += _write_shards(raw, out, seed, dtype, progress, save_file, weights)
    for fn in written:
        os.chmod(os.path.join(out, fn), mode)
    return out


def _model_tensor(model: KimiModel, place) -> torch.Tensor:
    """The part of `model`'s parameter that one checkpoint tensor holds, in the checkpoint's shape."""
    t = model.get_parameter(place.param).detach()
    if place.index is not None:
        t = t[place.index]
    if place.rows is not None:
        t = t[place.rows[0]:place.rows[1]]
    return t.reshape(place.shape)


def _write_shards(raw: dict, out: str, seed: int, dtype: torch.dtype, progress, save_file,
                  weights: KimiModel | None = None) -> list[str]:
    c = ModelConfig.from_dict(raw)
    table = expected_tensors(c)
    quantized = quantized_linears(c)
    groups: dict[str, list[str]] = {}
    for name in table:
        key = name.split(".")[1] if name.startswith("layers.") else "top"
        groups.setdefault(key, []).append(name)
    weight_map: dict[str, str] = {}
    files = []
    for n, (key, names) in enumerate(groups.items()):
        fn = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            full = checkpoint_name(name, c)
            if weights is not None:
                t = _model_tensor(weights, table[name]).to(tensor_dtype(name, dtype)).contiguous()
            else:
                t = init_tensor_(name, torch.empty(table[name].shape, dtype=tensor_dtype(name, dtype)), c, seed)
            if name in quantized:
                scheme = quantized[name]
                for suffix, v in encode(c.quant.layout, scheme.format, scheme.granularity, t).items():
                    tensors[full[:-len("weight")] + suffix] = v.contiguous()
            else:
                tensors[full] = t
        weight_map.update(dict.fromkeys(tensors, fn))
        save_file(tensors, os.path.join(out, fn), metadata={"format": "pt"})
        files.append(fn)
        if progress:
            progress(n + 1, len(groups))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return files + ["model.safetensors.index.json"]
