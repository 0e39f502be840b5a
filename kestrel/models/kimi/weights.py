"""Checkpoint tensor names -> reference parameters, and the loader.

One table (`expected_tensors`) lists, for a config, every tensor a Moonshot-layout checkpoint holds and where it
goes. Other spellings are folded onto it by `canonical_name` before the lookup: the `model.` / `language_model.`
prefixes, HF transformers' `save_pretrained` (dense layer 0 under `block_sparse_moe.`), attention-residual tensors
written as `*_res.proj_weight`. Coverage is checked both ways: a checkpoint tensor with no place is an error, a
place no tensor filled is an error, a shape mismatch is an error, each naming the tensor. Tensors of the parts
Kestrel does not serve (K3's vision tower and projector, MTP layers) are skipped with one log line.

Quantized checkpoints (config.json `quantization_config` or `hf_quant_config.json`): the linear layers the config
quantizes are listed in the same table in their stored forms (kestrel/quant/tensors.py: `weight_packed`,
`weight_scale`, `weight_global_scale`, `weight_scale_2`, `input_scale`, ...), each with its shape and the dtypes
accepted, and are loaded into a `QuantizedWeight` that the reference dequantizes on the fly.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from kestrel.config import ARCH_KIMI_K3, ModelConfig, QuantScheme
from kestrel.errors import CheckpointError, ConfigError
from kestrel.parallel.mapping import Mapping
from kestrel.parallel.shard import Shard, local_expert, shard_for
from kestrel.quant.tensors import QuantizedWeight, encode, tensor_forms

log = logging.getLogger("kestrel.weights")

# Parameters kept in fp32 whatever the model dtype (decay and routing constants the checkpoints store in fp32).
FP32_PARAMS = re.compile(r"(A_log|dt_bias|e_score_correction_bias)$")
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "vision_model.")


@dataclass(frozen=True)
class Place:
    """Where one checkpoint tensor goes: parameter `param`, index `index` of its first dim (stacked experts) and
    rows `rows` (w1 / w3 halves of w13), reshaped to `shape`. `linear`: a linear layer's weight (one a quantized
    checkpoint may store quantized). A quantized form also names its `part` of the weight, its scheme `quant`
    (format, granularity), the `dtypes` accepted, and whether it is `optional`; shape () is a scalar ([] or [1])."""
    param: str
    shape: tuple[int, ...]
    index: int | None = None
    rows: tuple[int, int] | None = None
    linear: bool = False
    part: str | None = None
    quant: tuple[str, str] | None = None
    dtypes: tuple[torch.dtype, ...] = ()
    optional: bool = False
    # several ranks (kestrel/parallel/shard.py): the rank's slice of the checkpoint tensor (None: all of it), and
    # whether the rank holds the tensor at all (a routed expert of another expert-parallel rank: never read)
    shard: Shard | None = None
    held: bool = True

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard.local_shape(self.shape) if self.shard is not None else self.shape


def expected_tensors(c: ModelConfig, quantized: dict[str, QuantScheme] | None = None,
                     mapping: Mapping | None = None) -> dict[str, Place]:
    """Every tensor of a Moonshot-layout checkpoint for this config (names without the `model.` prefix, except
    `lm_head.weight`), with its place and checkpoint shape. `quantized` maps linear weights (`X.weight`) to the
    scheme they are stored in (see `quantized_modules`); those are listed in their quantized forms instead.
    `mapping` (several ranks): each place also says which slice of the tensor this rank holds."""
    t: dict[str, Place] = {}
    hid = c.hidden_size

    def lin(name: str, n_out: int, n_in: int) -> None:
        t[name + ".weight"] = Place(name + ".weight", (n_out, n_in), linear=not name.endswith("block_sparse_moe.gate"))

    def vec(name: str, n: int, ckpt: str | None = None) -> None:
        t[ckpt or name + ".weight"] = Place(name, (n,))

    t["embed_tokens.weight"] = Place("embed_tokens", (c.vocab_size, hid))
    vec("norm", hid)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = Place("lm_head", (c.vocab_size, hid))
    if c.attn_res_block_size:
        t["output_attn_res_proj.weight"] = Place("output_attn_res_proj", (1, hid))
        vec("output_attn_res_norm", hid)
    for i, kind in enumerate(c.layer_kinds):
        p = f"layers.{i}."
        vec(p + "input_layernorm", hid)
        vec(p + "post_attention_layernorm", hid)
        if c.attn_res_block_size:
            for r in ("self_attention_res", "mlp_res"):
                t[f"{p}{r}_proj.weight"] = Place(f"{p}{r}_proj", (1, hid))
                vec(f"{p}{r}_norm", hid)
        a = p + "self_attn."
        if kind == "kda":
            W, H, D, K = c.kda_width, c.kda_num_heads, c.kda_head_dim, c.conv_kernel_size
            for n in ("q_proj", "k_proj", "v_proj"):
                lin(a + n, W, hid)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                t[a + n + ".weight"] = Place(a + n, (W, 1, K))
            lin(a + "f_a_proj", D, hid)
            lin(a + "f_b_proj", W, D)
            t[a + "A_log"] = Place(a + "A_log", (H,))
            t[a + "dt_bias"] = Place(a + "dt_bias", (W,))
            lin(a + "b_proj", H, hid)
            if c.kda_full_rank_output_gate:
                lin(a + "g_proj", W, hid)
            else:
                lin(a + "g_a_proj", D, hid)
                lin(a + "g_b_proj", W, D)
            vec(a + "o_norm", D)
            lin(a + "o_proj", hid, W)
        else:
            H = c.num_heads
            if c.q_lora_rank:
                lin(a + "q_a_proj", c.q_lora_rank, hid)
                vec(a + "q_a_layernorm", c.q_lora_rank)
                lin(a + "q_b_proj", H * c.qk_head_dim, c.q_lora_rank)
            else:
                lin(a + "q_proj", H * c.qk_head_dim, hid)
            lin(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, hid)
            vec(a + "kv_a_layernorm", c.kv_lora_rank)
            lin(a + "kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            if c.mla_use_output_gate:
                lin(a + "g_proj", H * c.v_head_dim, hid)
            lin(a + "o_proj", hid, H * c.v_head_dim)
        if c.is_moe_layer(i):
            m = p + "block_sparse_moe."
            width, inter = c.routed_expert_hidden_size or hid, c.moe_intermediate_size
            lin(m + "gate", c.num_experts, hid)
            t[m + "gate.e_score_correction_bias"] = Place(m + "gate.e_score_correction_bias", (c.num_experts,))
            for e in range(c.num_experts):
                x = f"{m}experts.{e}."
                t[x + "w1.weight"] = Place(m + "experts.w13", (inter, width), index=e, rows=(0, inter), linear=True)
                t[x + "w3.weight"] = Place(m + "experts.w13", (inter, width), index=e, rows=(inter, 2 * inter),
                                           linear=True)
                t[x + "w2.weight"] = Place(m + "experts.w2", (width, inter), index=e, linear=True)
            if c.n_shared_experts:
                si = inter * c.n_shared_experts
                lin(m + "shared_experts.gate_proj", si, hid)
                lin(m + "shared_experts.up_proj", si, hid)
                lin(m + "shared_experts.down_proj", hid, si)
            if c.routed_expert_hidden_size:
                lin(m + "routed_expert_down_proj", width, hid)
                lin(m + "routed_expert_up_proj", hid, width)
                if c.latent_moe_use_norm:
                    vec(m + "routed_expert_norm", width)
        else:
            for n, shape in (("gate_proj", (c.intermediate_size, hid)), ("up_proj", (c.intermediate_size, hid)),
                             ("down_proj", (hid, c.intermediate_size))):
                lin(p + "mlp." + n, *shape)
    quantized = quantized or {}
    by_param: dict[str, set] = {}
    for name, place in t.items():
        if place.linear:
            by_param.setdefault(place.param, set()).add(quantized.get(name))
    mixed = next((p for p, schemes in by_param.items() if len(schemes) > 1), None)
    if mixed is not None:   # one stacked parameter (w13 / w2 of a layer's experts) holds one storage form
        raise CheckpointError(f"quantization_config stores the weights of {mixed} in several forms "
                              f"({sorted(s.format if s else 'unquantized' for s in by_param[mixed])}); Kestrel "
                              "needs every expert of a layer (w1, w2, w3) in one form")
    for name, scheme in quantized.items():
        place = t.pop(name)
        module = name[:-len(".weight")]
        try:
            forms = tensor_forms(c.quant.layout, scheme.format, scheme.granularity, *place.shape)
        except ValueError as e:
            raise CheckpointError(f"quantization_config stores {module} as {scheme.format}, which Kestrel cannot "
                                  f"read: {e}; re-export it with that layer unquantized (ignore list)")
        for f in forms:
            t[f"{module}.{f.suffix}"] = Place(place.param, f.shape, place.index, place.rows, True, f.part,
                                              (scheme.format, scheme.granularity), f.dtypes, f.optional)
    if mapping is not None and mapping.parallel:
        t = {name: _shard_place(name, place, c, mapping) for name, place in t.items()}
    return t


def _shard_place(name: str, place: Place, c: ModelConfig, mapping: Mapping) -> Place:
    """The place as one rank holds it: its slice (shard.py), its expert's index among the rank's experts, and the
    w1 / w3 rows of w13 in the rank's share of the intermediate dimension."""
    from dataclasses import replace
    shard = shard_for(name, c, mapping)
    index, rows = place.index, place.rows
    if index is not None:                       # a routed expert
        index = local_expert(index, c.num_experts, mapping)
        if index is None:
            return replace(place, held=False)
        if rows is not None and mapping.moe_tp > 1:
            n = (rows[1] - rows[0]) // mapping.moe_tp
            rows = (rows[0] // mapping.moe_tp, rows[0] // mapping.moe_tp + n)
    if shard is not None:
        try:
            shard.local_shape(place.shape)
        except ValueError:
            raise ConfigError(f"{name} {list(place.shape)} does not split over {shard.parts} ranks along dim "
                              f"{shard.dim} (a quantization block or head would be cut); use fewer ranks") from None
    return replace(place, shard=shard, index=index, rows=rows)


QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_scale_2", "input_scale",
                  "input_global_scale", "weight_zero_point")


def quantized_modules(c: ModelConfig, names) -> dict[str, QuantScheme]:
    """The linear weights (canonical `X.weight`) that the checkpoint's quantization config quantizes, judged by the
    module names as the checkpoint spells them (the config's targets and ignore lists are written in those)."""
    if c.quant is None:
        return {}
    plain = expected_tensors(c)
    out: dict[str, QuantScheme] = {}
    for name in names:
        module = name.rpartition(".")[0]
        canon = canonical_name(module + ".weight", c)
        place = plain.get(canon) if canon else None
        if place is not None and place.linear:
            scheme = c.quant.scheme_for(module)
            if scheme is not None:
                out[canon] = scheme
    return out


def checkpoint_name(canon: str, c: ModelConfig) -> str:
    """The name a canonical tensor has in a Moonshot-layout checkpoint as `make-checkpoint` writes it (K3 under
    `language_model.`, Kimi Linear under `model.`): the spelling a config's quantization targets are matched on
    when there is no checkpoint to read names from (`--load-format random`, the memory check)."""
    k3 = c.arch == ARCH_KIMI_K3
    if canon == "lm_head.weight":
        return "language_model.lm_head.weight" if k3 else canon
    return ("language_model.model." if k3 else "model.") + canon


def quantized_linears(c: ModelConfig, table: dict[str, Place] | None = None,
                      first_expert_only: bool = False) -> dict[str, QuantScheme]:
    """`quantized_modules` over the names `make-checkpoint` / `kestrel quantize` write for this config (`table`:
    its `expected_tensors`, when the caller has it). `first_expert_only`: expert 0 stands for its layer's stack
    (one stacked weight holds one form), for callers that only ask which kinds of layer are quantized."""
    if c.quant is None:
        return {}
    out = {}
    for name, place in (table if table is not None else expected_tensors(c)).items():
        if place.linear and not (first_expert_only and place.index):
            scheme = c.quant.scheme_for(checkpoint_name(name, c)[:-len(".weight")])
            if scheme is not None:
                out[name] = scheme
    return out


def weights_nbytes(c: ModelConfig, dtype: torch.dtype, mapping: Mapping | None = None,
                   fp8_weight_read: str = "none") -> int:
    """Bytes the model's parameters take in `dtype` (the fp32 constants in fp32; quantized weights as stored, with
    their scales), from the table alone; with a `mapping`, on one rank. `fp8_weight_read`: the projections that
    flag converts count as e4m3 values and an fp32 scale per row (kestrel/models/kimi/fp8_read.py)."""
    from kestrel.models.kimi.fp8_read import moe_mlp_groups
    size = {False: torch.empty((), dtype=dtype).element_size(), True: 4}
    to_fp8 = {n for g in moe_mlp_groups(c) for n in g} if fp8_weight_read != "none" else set()
    table = expected_tensors(c, quantized_linears(c), mapping)
    values = {n.rpartition(".")[0]: p.local_shape for n, p in table.items() if p.part == "values"}
    total = 0
    for name, p in table.items():
        if not p.held or p.part == "input_scale":
            continue
        if p.part is None and p.param in to_fp8:
            rows = p.local_shape[0]
            total += math.prod(p.local_shape) + 4 * rows
        elif p.part is None:
            total += math.prod(p.local_shape) * size[bool(FP32_PARAMS.search(p.param))]
        elif p.part == "second" or (p.part == "scale" and p.quant[0] == "fp8"):
            # QuantizedWeight widens tensor scales to fp32 per row, FP8 block scales to a row of K / 128
            rows, k = values[name.rpartition(".")[0]]
            total += 4 * rows * (-(-k // 128) if p.quant[1] == "block" and p.part == "scale" else 1)
        else:
            total += math.prod(p.local_shape) * p.dtypes[0].itemsize
    return total


_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def canonical_name(name: str, c: ModelConfig) -> str | None:
    """The Moonshot-layout name of a checkpoint tensor, or None for a tensor Kestrel skips on purpose."""
    for prefix in ("language_model.model.", "language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith(SKIPPED_PREFIXES) or "rotary_emb." in name:
        return None
    name = re.sub(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)_weight$", r"\1_\2.weight", name)
    m = _LAYER.match(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if i >= c.num_layers:
            # K3's MTP / next-token-prediction layers follow the text model; Kimi Linear has none, so there a layer
            # past num_hidden_layers is an unexpected tensor (a config that does not match), never silently dropped
            return None if c.arch == ARCH_KIMI_K3 else name
        # the FFN container: Moonshot writes `mlp.` for dense layers and `block_sparse_moe.` for MoE layers;
        # HF's save_pretrained writes `block_sparse_moe.` for both, other exports `mlp.` for both
        for container in ("mlp.", "block_sparse_moe."):
            if rest.startswith(container):
                rest = ("block_sparse_moe." if c.is_moe_layer(i) else "mlp.") + rest[len(container):]
                break
        name = f"layers.{i}.{rest}"
    return name


def _skip_reason(name: str) -> str:
    if "vision" in name or "mm_projector" in name or "multi_modal" in name:
        return "vision tower / projector"
    if "rotary_emb" in name:
        return "rotary tables"
    return "MTP layers"


# ---------------------------------------------------------------------------------------------------------------
# reading safetensors shards

def shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); re-export the checkpoint")
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(path, fn)):
                raise CheckpointError(f"{path}: shard {fn} named in model.safetensors.index.json is missing")
        return [os.path.join(path, fn) for fn in files]
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files; point --model at a checkpoint directory, or pass "
                              "--load-format random for seeded random weights")
    return [os.path.join(path, fn) for fn in files]


def _check_shard(fn: str) -> int:
    """A truncated download must fail here, naming the file, not as a bus error or garbage weights later."""
    size = os.path.getsize(fn)
    try:
        with open(fn, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{fn}: not a readable safetensors file ({e}); the file is truncated or corrupt")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{fn}: truncated ({size} bytes, header promises {8 + n + end}); download it again")
    return len(header) - ("__metadata__" in header)


def iter_checkpoint(path: str) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """(name, loader, shape) for every tensor of every shard; tensors are read only when `loader()` is called."""
    from safetensors import safe_open

    for fn in shard_files(path):
        with safe_open(fn, framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                yield name, (lambda slices=None, f=f, name=name: f.get_tensor(name) if slices is None
                             else f.get_slice(name)[slices]), shape


def progress_bar(total: int, desc: str, unit: str = "tensor"):
    """A tqdm bar on stderr when stderr is a terminal, else None (a log or a pipe gets one line per stage from the
    caller instead of a bar's carriage-return frames)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit=unit, desc=desc, leave=False, mininterval=0.5, file=sys.stderr)


class _Parameters:
    """The parameter tensors of a model built on the meta device, allocated on `device` when a checkpoint tensor
    first lands in them (decay and routing constants in fp32, the rest in `dtype`), then installed all at once."""

    def __init__(self, model: torch.nn.Module, table: dict[str, Place], dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.params = dict(model.named_parameters())
        unknown = [p.param for p in table.values() if p.param not in self.params]
        if unknown:  # the table and the model disagree: a Kestrel bug, not a user error
            raise RuntimeError(f"weights table names parameters the model lacks: {unknown[:3]}")
        self.filled: dict[str, torch.Tensor] = {}

    def slot(self, place: Place) -> torch.Tensor:
        """The part of its parameter that one checkpoint tensor fills, viewed in the checkpoint tensor's shape."""
        target = self.filled.get(place.param)
        if target is None:
            p = self.params[place.param]
            pdtype = torch.float32 if FP32_PARAMS.search(place.param) else self.dtype
            target = self.filled[place.param] = torch.empty(p.shape, dtype=pdtype, device=self.device)
        dst = target if place.index is None else target[place.index]
        if place.rows is not None:
            dst = dst[place.rows[0]:place.rows[1]]
        return dst.view(place.local_shape)

    def install(self) -> None:
        for name, tensor in self.filled.items():
            _assign(self.model, name, tensor)


def load_weights(model: torch.nn.Module, path: str, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, mapping: Mapping | None = None) -> None:
    """Fill every parameter of `model` (built on the meta device) from the checkpoint at `path`. With a `mapping`
    the model holds one rank's part, and only that part of each tensor is read from the shards."""
    table = expected_tensors(config, quantized_modules(config, (n for n, _, _ in iter_checkpoint(path))), mapping)
    params = _Parameters(model, table, dtype, device)
    seen: set[str] = set()
    skipped: dict[str, int] = {}
    shards = shard_files(path)
    total = sum(_check_shard(fn) for fn in shards)
    log.info("loading weights: %d tensors from %d shard%s in %s", total, len(shards), "s"[:len(shards) > 1], path)
    bar = progress_bar(total, "loading weights")
    try:   # close the bar on an error too: a leaked tqdm bar garbles every later bar of the process
        for name, load, shape in iter_checkpoint(path):
            if bar is not None:
                bar.update(1)
            canon = canonical_name(name, config)
            if canon is None:
                reason = _skip_reason(name)
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            place = table.get(canon)
            if place is None:
                if name.endswith(QUANT_SUFFIXES):
                    raise CheckpointError(f"{path}: tensor {name} belongs to a quantized weight, but config.json "
                                          f"does not quantize {name.rpartition('.')[0]} (no quantization_config, "
                                          "or its targets / ignore list leave it out); fix the config")
                raise CheckpointError(f"{path}: unexpected tensor {name} (shape {list(shape)}) for this config.json")
            if canon in seen:
                raise CheckpointError(f"{path}: tensor {name} appears twice (as {canon})")
            if place.shape == () and shape in ((), (1,)):
                pass
            elif shape != place.shape and not (math.prod(shape) == math.prod(place.shape) and _is_flat_variant(canon)):
                raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, config.json implies "
                                      f"{list(place.shape)}")
            seen.add(canon)
            if not place.held:
                continue
            if place.part is not None:
                _fill_quantized(params.filled, place, name, _read(load, shape, place),
                                params.params[place.param].shape, config, dtype, device, path)
                continue
            value = _read(load, shape, place)
            if value.dtype in _STORED_DTYPES:
                raise CheckpointError(f"{path}: tensor {name} is stored as {value.dtype}, but config.json does not "
                                      "quantize it; fix the quantization_config's targets / ignore list")
            dst = params.slot(place)
            dst.copy_(value.to(device=device, dtype=dst.dtype).reshape(dst.shape))
    finally:
        if bar is not None:
            bar.close()
    missing = [n for n, p in table.items() if n not in seen and not p.optional]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]}{more}; the checkpoint does not match config.json")
    for reason, n in skipped.items():
        log.info("skipped %d tensors of the %s (Kestrel serves the text model)", n, reason)
    params.install()


def init_weights(model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 init: Callable[[str, torch.Tensor], object], mapping: Mapping | None = None) -> None:
    """Fill every parameter of `model` (built on the meta device) without a checkpoint: `init(name, out)` writes
    checkpoint tensor `name` in place into `out`, its slice of the parameter on `device` in the checkpoint's shape
    (`--load-format random`). Tensor by tensor on the device: nothing is made on the host and copied over. With a
    `mapping`, a split tensor is drawn whole (one at a time) and the rank keeps its slice, so every layout holds
    the weights one rank would. A linear weight the config's `quantization_config` quantizes is drawn in `dtype`
    and quantized at once (`quant/tensors.encode`, as `kestrel quantize` does), one tensor at a time: the bf16
    model is never held whole."""
    plain = expected_tensors(config)
    quantized = quantized_linears(config, plain)
    table = expected_tensors(config, quantized, mapping) if quantized or mapping is not None else plain
    params = _Parameters(model, table, dtype, device)
    encoded: tuple[str, dict[str, torch.Tensor]] | None = None    # (module, its stored tensors by suffix)
    bar = progress_bar(len(table), "random weights")
    try:
        with torch.no_grad():
            for name, place in table.items():
                if bar is not None:
                    bar.update(1)
                if not place.held:
                    continue
                if place.part is not None:
                    module, _, suffix = name.rpartition(".")
                    if encoded is None or encoded[0] != module:
                        whole = torch.empty(plain[module + ".weight"].shape, dtype=dtype, device=device)
                        init(module + ".weight", whole)
                        scheme = quantized[module + ".weight"]
                        encoded = module, encode(config.quant.layout, scheme.format, scheme.granularity, whole)
                        del whole
                    value = encoded[1].get(suffix)
                    if value is not None:     # activation scales: none (weight-only), and optional
                        if place.shard is not None:
                            value = value.reshape(place.shape)[place.shard.slices(place.shape)]
                        _fill_quantized(params.filled, place, name, value, params.params[place.param].shape,
                                        config, dtype, device, "random weights")
                    continue
                slot = params.slot(place)
                if place.shard is None:
                    init(name, slot)
                else:
                    whole = torch.empty(place.shape, dtype=slot.dtype, device=device)
                    init(name, whole)
                    slot.copy_(whole[place.shard.slices(place.shape)])
    finally:
        if bar is not None:
            bar.close()
    params.install()


def _read(load, shape: tuple[int, ...], place: Place) -> torch.Tensor:
    """The rank's slice of a checkpoint tensor, read from the file as a slice (never the whole tensor) unless the
    file stores it in another view (A_log / dt_bias flat variants: tiny, read whole and sliced here)."""
    if place.shard is None:
        return load()
    if shape != place.shape:
        return load().reshape(place.shape)[place.shard.slices(place.shape)]
    return load(place.shard.slices(place.shape))


def _is_flat_variant(canon: str) -> bool:
    """A_log is written [H] or [1, 1, H, 1], dt_bias [H*D] or [H, D]: same numbers, other view."""
    return canon.endswith(("A_log", "dt_bias"))


_STORED_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def _fill_quantized(filled: dict, place: Place, name: str, value: torch.Tensor, shape: torch.Size,
                    config: ModelConfig, dtype: torch.dtype, device: torch.device, path: str) -> None:
    if value.dtype not in place.dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in place.dtypes)
        raise CheckpointError(f"{path}: tensor {name} has dtype {str(value.dtype).replace('torch.', '')}, "
                              f"{place.quant[0]} stores it as {want}; re-export the checkpoint")
    target = filled.get(place.param)
    if target is None:
        target = filled[place.param] = QuantizedWeight(config.quant.layout, *place.quant, tuple(shape), dtype, device)
    target.fill(place.part, value, place.index, place.rows)


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(tensor, QuantizedWeight):   # the reference reads it through `dequantize()`
        delattr(mod, attr)
        mod.add_module(attr, tensor)
        return
    setattr(mod, attr, torch.nn.Parameter(tensor, requires_grad=False))
