"""`kestrel quantize`: a bf16 / fp32 Kimi checkpoint -> an MXFP4 / NVFP4 / MXFP8 / FP8 checkpoint in the
compressed-tensors or ModelOpt layout, weight-only (no activation scales: nothing is calibrated).

It works one shard at a time (read a shard, quantize the layers in it, write it, drop it), so a real-width model
never needs more memory than its largest shard. `--modules experts` quantizes the routed experts (the usual K3
split: FP4 experts, BF16 trunk); `all-linear` every linear layer except the router gates and the LM head, and
leaves a layer whose input width does not divide into the format's blocks unquantized (listed in the config's
ignore list, one log line). The written config is read by Kestrel's loader and by compressed-tensors'
`CompressedTensorsDequantizer`, which tests cross-check.

This module is a command: it reads the model's name table (models/kimi/weights.py) to find the linear layers;
the format modules beside it import only torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys

from kestrel.config import ModelConfig
from kestrel.errors import CheckpointError, KestrelError
from kestrel.quant.formats import FORMATS, FP8_GRANULARITIES
from kestrel.quant.tensors import block_of, encode

log = logging.getLogger("kestrel.quantize")

LAYOUTS = ("compressed-tensors", "modelopt")
MODULES = ("experts", "all-linear")
_CT_FORMAT_NAMES = {"mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp8": "mxfp8-quantized",
                    "fp8": "float-quantized"}


def _ct_weight_args(fmt: str, granularity: str) -> dict:
    """compressed-tensors QuantizationArgs (as its JSON) of each format, as its presets MXFP4A16 / NVFP4A16 /
    MXFP8A16 / FP8 (weights) write them."""
    base = {"type": "float", "symmetric": True, "dynamic": False}
    if fmt == "mxfp4":
        return dict(base, num_bits=4, strategy="group", group_size=32, scale_dtype="torch.uint8")
    if fmt == "nvfp4":
        return dict(base, num_bits=4, strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
    if fmt == "mxfp8":
        return dict(base, num_bits=8, strategy="group", group_size=32, scale_dtype="torch.uint8")
    args = dict(base, num_bits=8, strategy=granularity, group_size=None)
    if granularity == "block":
        args["block_structure"] = [128, 128]
    return args


def quant_config(layout: str, fmt: str, granularity: str, quantized: list[str], linear: list[str],
                 plain: list[str]) -> dict:
    """The `quantization_config` of the checkpoint `quantize_checkpoint` writes (ModelOpt: also the `quantization`
    object of hf_quant_config.json), from module names as the checkpoint spells them: `quantized`, the
    unquantized `linear` layers, and every other module with a `weight`, `plain`.

    compressed-tensors' dequantizer matches tensor names only (no module classes), so a "Linear" target would also
    claim embeddings and convolutions; the targets are therefore one regex over the quantized layers' last names
    (`q_proj`, `w1`, ...) and the ignore list names the unquantized modules that regex also matches. ModelOpt's
    readers know the model's classes: its exclude list names the unquantized linear layers."""
    if layout == "modelopt":
        algo = {"nvfp4": "NVFP4", "fp8": "FP8"}[fmt]
        q = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": sorted(linear)}
        if fmt == "nvfp4":
            q["group_size"] = 16
        return dict(q, quant_method="modelopt")
    leaves = sorted({m.rpartition(".")[2] for m in quantized})
    target = r"re:.*\.(?:" + "|".join(re.escape(x) for x in leaves) + ")$"
    ignore = sorted(m for m in linear + plain if re.match(target[3:], m))
    return {"quant_method": "compressed-tensors", "format": _CT_FORMAT_NAMES[fmt], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": [target], "weights": _ct_weight_args(fmt, granularity),
                                          "input_activations": None, "output_activations": None,
                                          "format": _CT_FORMAT_NAMES[fmt]}},
            "ignore": ignore, "kv_cache_scheme": None}


def quantize_checkpoint(model: str, out: str, fmt: str, modules: str = "experts",
                        layout: str = "compressed-tensors", granularity: str = "block",
                        progress: bool | None = None) -> dict:
    """Write the quantized checkpoint of `model` to `out`; returns the quantization_config written."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from kestrel.models.kimi.weights import canonical_name, expected_tensors, shard_files

    if fmt not in FORMATS:
        raise KestrelError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if layout not in LAYOUTS or modules not in MODULES:
        raise KestrelError(f"--layout {layout!r} --modules {modules!r}: use {'|'.join(LAYOUTS)} and "
                           f"{'|'.join(MODULES)}")
    if layout == "modelopt" and fmt not in ("nvfp4", "fp8"):
        raise KestrelError(f"--layout modelopt stores nvfp4 and fp8 (ModelOpt has no {fmt} export); use "
                           "--layout compressed-tensors")
    if granularity not in FP8_GRANULARITIES:
        raise KestrelError(f"--fp8-granularity {granularity!r}: use one of {', '.join(FP8_GRANULARITIES)}")
    if layout == "modelopt" and fmt == "fp8":
        granularity = "tensor"          # ModelOpt's FP8 is per-tensor
    if fmt != "fp8":
        granularity = "group"
    config = ModelConfig.from_dir(model)
    if config.quant is not None:
        raise CheckpointError(f"--model {model}: the checkpoint is already quantized ({config.quant.layout} "
                              f"{config.quant.weight_format}); quantize its bf16 original")
    if os.path.abspath(out) == os.path.abspath(model):
        raise KestrelError("--out must differ from --model")
    os.makedirs(out, exist_ok=True)
    table = expected_tensors(config)
    files = shard_files(model)
    total = sum(len(safe_open(fn, framework="pt").keys()) for fn in files)
    bar = _bar(total, progress)
    weight_map: dict[str, str] = {}
    quantized: list[str] = []
    unquantized: list[str] = []     # linear layers left as they were
    plain: list[str] = []           # other modules with a weight (embeddings, convolutions, norms)
    try:
        for fn in files:
            tensors = {}
            with safe_open(fn, framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    canon = canonical_name(name, config)
                    place = table.get(canon) if canon else None
                    module = name[:-len(".weight")] if name.endswith(".weight") else None
                    if _chosen(name, module, place, t.shape[-1], fmt, modules):
                        for suffix, v in encode(layout, fmt, granularity, t).items():
                            tensors[f"{module}.{suffix}"] = v.contiguous()
                        quantized.append(module)
                    else:
                        if module is not None:
                            (unquantized if _is_linear(canon, place) else plain).append(module)
                        tensors[name] = t
                    if bar is not None:
                        bar.update(1)
            shard = os.path.basename(fn)
            save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
            weight_map.update({n: shard for n in tensors})
            del tensors
    finally:
        if bar is not None:
            bar.close()
    done = len(quantized)
    if not done:
        raise KestrelError(f"--modules {modules}: no layer of {model} was quantized")
    qc = quant_config(layout, fmt, granularity, quantized, unquantized, plain)
    _write_metadata(model, out, qc, weight_map)
    log.info("quantized %d linear weights to %s (%s layout), %d left unquantized; written to %s", done, fmt, layout,
             len(unquantized), out)
    return qc


def _chosen(name: str, module: str | None, place, k: int, fmt: str, modules: str) -> bool:
    """Whether checkpoint tensor `name` (a `module`'s weight, input width k) is quantized under `--modules`: a
    quantizable linear layer (every one, or the routed experts alone), unless its width does not divide into the
    format's blocks (a routed expert then is an error: one stacked weight holds one form)."""
    if place is None or not place.linear or module is None or not (modules == "all-linear" or place.index is not None):
        return False
    block = block_of(fmt)
    if block and k % block:
        if place.index is not None:
            raise KestrelError(f"{name}: input width {k} is not a multiple of the {fmt} block ({block}); the "
                               f"routed experts cannot be stored as {fmt}")
        log.info("%s stays unquantized: input width %d is not a multiple of %d", module, k, block)
        return False
    return True


def config_quantization(config: ModelConfig, fmt: str, modules: str = "experts",
                        layout: str = "compressed-tensors", granularity: str = "block") -> dict:
    """The `quantization_config` `quantize_checkpoint` writes for the checkpoint `make-checkpoint` writes for
    `config`, from the name table alone (no shard is read): `make-checkpoint --quant` (a folder for a quantized
    `--load-format random`) and the contract's quantized meta models."""
    from kestrel.models.kimi.weights import checkpoint_name, expected_tensors
    if fmt != "fp8":
        granularity = "group"
    elif layout == "modelopt":
        granularity = "tensor"          # ModelOpt's FP8 is per-tensor
    quantized, unquantized, plain = [], [], []
    for canon, place in expected_tensors(config).items():
        if not canon.endswith(".weight"):
            continue
        name = checkpoint_name(canon, config)
        module = name[:-len(".weight")]
        if _chosen(name, module, place, place.shape[-1], fmt, modules):
            quantized.append(module)
        else:
            (unquantized if _is_linear(canon, place) else plain).append(module)
    return quant_config(layout, fmt, granularity, quantized, unquantized, plain)


def _is_linear(canon: str | None, place) -> bool:
    """A linear layer as the libraries see one (their "Linear" target): Kestrel's quantizable ones, the router gates
    and the LM head (those two stay unquantized, so the config must say so)."""
    return place is not None and (place.linear or canon == "lm_head.weight"
                                  or canon.endswith("block_sparse_moe.gate.weight"))


def _write_metadata(model: str, out: str, qc: dict, weight_map: dict[str, str]) -> None:
    for fn in os.listdir(model):
        src = os.path.join(model, fn)
        if (os.path.isfile(src) and not fn.endswith(".safetensors")
                and fn not in ("config.json", "model.safetensors.index.json", "hf_quant_config.json")):
            shutil.copy(src, os.path.join(out, fn))
    with open(os.path.join(model, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    if qc["quant_method"] == "modelopt":
        q = {k: v for k, v in qc.items() if k != "quant_method"}
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "kestrel"}, "quantization": q}, f, indent=2)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)


def _bar(total: int, progress: bool | None):
    """A tqdm bar on a terminal only (a log file gets the summary line instead)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="tensor", desc="quantizing", mininterval=0.5)


# ---------------------------------------------------------------------------------------------------------------
# the command

def cmd_quantize(args: argparse.Namespace) -> int:
    try:
        quantize_checkpoint(args.model, args.out, args.format, args.modules, args.layout, args.fp8_granularity)
    except OSError as e:
        raise KestrelError(f"--out {args.out}: cannot write the checkpoint there ({e.strerror or e})")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `kestrel quantize` on an argparse subparsers object."""
    q = subparsers.add_parser("quantize", help="write an MXFP4 / NVFP4 / MXFP8 / FP8 copy of a bf16 checkpoint")
    q.add_argument("--model", required=True, help="bf16 / fp32 checkpoint directory")
    q.add_argument("--out", required=True, help="directory for the quantized checkpoint")
    q.add_argument("--format", required=True, choices=FORMATS)
    q.add_argument("--modules", default="experts", choices=MODULES,
                   help="experts: routed experts only (the K3 split); all-linear: every linear but gates and head")
    q.add_argument("--layout", default="compressed-tensors", choices=LAYOUTS)
    q.add_argument("--fp8-granularity", default="block", choices=FP8_GRANULARITIES,
                   help="fp8 scales per tensor, output channel or 128x128 block (ModelOpt: tensor)")
    q.set_defaults(func=cmd_quantize)
    return q


def register(subparsers, add_engine_args=None) -> None:
    """The hook kestrel/cli.py's `_optional_commands` calls."""
    add_parser(subparsers)
