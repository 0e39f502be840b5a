"""Quantized checkpoints end to end: `kestrel quantize` and compressed-tensors' own compressor write tiny HF
KimiLinear (and K3-preset) checkpoints in every format and both layouts; Kestrel loads them; the reference's
logits equal those of the fp32 model whose weights are replaced by the dequantized values; compressed-tensors'
dequantizer reads our files to the same values; bad scales are refused naming the tensor; the router keeps
quantized checkpoints off the bf16 targets."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from helpers import copy_checkpoint, hf_model, load_model, prefill_all_logits, read_tensors, rel_err, save_hf, \
    scratch_dir, tiny_checkpoint, write_tensors
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel.config import ModelConfig, parse_quant
from kestrel.errors import CheckpointError, ConfigError, KestrelError
from kestrel.quant import QuantizedWeight
from kestrel.quant.formats import dequantize_fp8, dequantize_mx, dequantize_nvfp4
from kestrel.quant.quantize import add_parser, quantize_checkpoint

# KDA first, an MLA layer, 1 dense layer, 4 experts; widths 64 / 32 / 16 so that some layers (K = 16) do not divide
# into MX blocks
HF_CONFIG = dict(vocab_size=256, rms_norm_eps=1e-5, routed_scaling_factor=2.446, linear_conv_kernel_dim=4,
                 hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                 qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1,
                 linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                                     "short_conv_kernel_size": 4})
IDS = list(range(5, 45, 2)) + [200, 17, 3, 255]


@pytest.fixture(scope="module")
def hf_dir():
    return save_hf(hf_model(0, **HF_CONFIG), "hf-tiny")


def logits(path):
    config, model = load_model(path)
    return prefill_all_logits(model, config, IDS), model


def dequantized(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every quantized linear replaced by its fp32 weight, decoded straight from the
    stored tensors by the format functions (not through the loader's stacking and QuantizedWeight)."""
    q = ModelConfig.from_dir(path).quant
    t = read_tensors(path)
    modules = {n.rpartition(".")[0] for n in t if n.endswith(".weight_scale")}
    for m in modules:
        s = q.scheme_for(m)
        pop = lambda suffix: t.pop(f"{m}.{suffix}", None)
        t.pop(f"{m}.input_scale", None)
        t.pop(f"{m}.input_global_scale", None)
        if s.format == "mxfp4":
            w = dequantize_mx(pop("weight_packed"), pop("weight_scale"))
        elif s.format == "mxfp8":
            w = dequantize_mx(pop("weight"), pop("weight_scale"))
        elif s.format == "nvfp4" and q.layout == "compressed-tensors":
            w = dequantize_nvfp4(pop("weight_packed"), pop("weight_scale"), pop("weight_global_scale"))
        elif s.format == "nvfp4":
            w = dequantize_nvfp4(pop("weight"), pop("weight_scale"), pop("weight_scale_2"), divisor=False)
        else:
            w = dequantize_fp8(pop("weight"), pop("weight_scale").reshape(-1, 1) if s.granularity != "block"
                               else t.pop(f"{m}.weight_scale"), s.granularity)
        t[f"{m}.weight"] = w
    return t


def dense_copy(path: str) -> str:
    """A plain fp32 checkpoint of the dequantized weights (no quantization config)."""
    dense = dequantized(path)
    out = copy_checkpoint(path, "dense", transform=lambda _: dense,
                          config_edit=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    if os.path.exists(os.path.join(out, "hf_quant_config.json")):
        os.remove(os.path.join(out, "hf_quant_config.json"))
    return out


def assert_ct_reads_same(path: str, fmt: str) -> None:
    """compressed-tensors' CompressedTensorsDequantizer decodes our files to our values (NVFP4: it rounds to bf16
    on the way, so compare there); `validate` also proves no quantization tensor is left untargeted."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    theirs = CompressedTensorsDequantizer(path, dtype=torch.float32).validate(read_tensors(path))
    ours = dequantized(path)
    assert set(theirs) == set(ours)
    decoded = {n.rpartition(".")[0] + ".weight" for n in read_tensors(path) if n.endswith(".weight_scale")}
    for name, t in ours.items():
        if fmt == "nvfp4" and name in decoded:
            t = t.to(torch.bfloat16).float()
        assert torch.equal(theirs[name], t), name


CASES = [("mxfp4", "experts", "compressed-tensors"), ("mxfp4", "all-linear", "compressed-tensors"),
         ("nvfp4", "experts", "compressed-tensors"), ("nvfp4", "all-linear", "modelopt"),
         ("mxfp8", "all-linear", "compressed-tensors"), ("fp8", "all-linear", "compressed-tensors"),
         ("fp8", "experts", "modelopt")]


@pytest.mark.parametrize("fmt,modules,layout", CASES, ids=["-".join(c) for c in CASES])
def test_quantized_checkpoint_runs_like_its_dequantized_weights(hf_dir, fmt, modules, layout):
    out = scratch_dir(f"q-{fmt}")
    qc = quantize_checkpoint(hf_dir, out, fmt, modules, layout)
    config = ModelConfig.from_dir(out)
    assert config.quant.layout == layout and config.quant.weight_format == fmt
    got, model = logits(out)
    stored = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    n_expected = 2 * 2 if modules == "experts" else 11      # w13 + w2 of the 2 MoE layers; or every linear but some
    assert len(stored) >= n_expected and all(m.format == fmt for m in stored)
    want, _ = logits(dense_copy(out))
    assert rel_err(got, want) <= 1e-5
    base, _ = logits(hf_dir)
    assert rel_err(got, base) > 1e-4          # the weights really were quantized
    if layout == "compressed-tensors":
        assert_ct_reads_same(out, fmt)
        from compressed_tensors.quantization import QuantizationConfig
        QuantizationConfig.model_validate(qc)
    else:
        with open(os.path.join(out, "hf_quant_config.json")) as f:
            assert json.load(f)["quantization"]["quant_algo"] == fmt.upper()


def test_mx_layers_that_do_not_divide_stay_unquantized(hf_dir):
    out = scratch_dir("q-skip")
    quantize_checkpoint(hf_dir, out, "mxfp4", "all-linear")
    q = ModelConfig.from_dir(out).quant
    names = read_tensors(out)
    for kept in ("model.layers.0.self_attn.f_b_proj", "lm_head", "model.layers.1.block_sparse_moe.gate",
                 "model.embed_tokens", "model.layers.0.self_attn.q_conv1d"):      # K = 16, head, router, others
        assert q.scheme_for(kept) is None and kept + ".weight" in names
    assert q.scheme_for("model.layers.0.self_attn.q_proj") and "model.layers.0.self_attn.q_proj.weight_packed" in names
    assert_ct_reads_same(out, "mxfp4")


def test_k3_preset_mxfp4_experts():
    src = tiny_checkpoint("k3-tiny")
    out = scratch_dir("q-k3")
    quantize_checkpoint(src, out, "mxfp4")
    got, model = logits(out)
    assert sum(isinstance(m, QuantizedWeight) for m in model.modules()) == 2 * sum(
        model.config.is_moe_layer(i) for i in range(model.config.num_layers))
    want, _ = logits(dense_copy(out))
    assert rel_err(got, want) <= 1e-5
    assert_ct_reads_same(out, "mxfp4")


# ---------------------------------------------------------------------------------------------------------------
# checkpoints compressed-tensors itself writes

def ct_compress(src: str, preset: str) -> str:
    """The routed experts of `src` quantized by compressed-tensors: its observers' qparams and its compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    scheme = preset_name_to_scheme(preset, [r"re:.*experts\.\d+\.w[123]$"])
    scheme.format = infer_module_format(torch.nn.Linear, scheme)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    a = scheme.weights

    def transform(tensors):
        out = {}
        for name, w in tensors.items():
            if ".experts." not in name:
                out[name] = w
                continue
            sd = {"weight": w}
            n, k = w.shape
            if a.strategy in ("group", "tensor_group"):
                x = w.view(n, k // a.group_size, a.group_size)
                gs = generate_gparam(w.min(), w.max()) if a.strategy == "tensor_group" else None
                if gs is not None:
                    sd["weight_global_scale"] = gs
                sd["weight_scale"] = calculate_qparams(x.amin(-1), x.amax(-1), a, global_scale=gs)[0]
            elif a.strategy == "channel":
                sd["weight_scale"] = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), a)[0]
            else:  # 128x128 blocks (one partial block at these widths)
                sd["weight_scale"] = calculate_qparams(w.amin().view(1, 1), w.amax().view(1, 1), a)[0]
            module = name[:-len(".weight")]
            out.update({f"{module}.{k}": v for k, v in compressor.compress(sd, scheme).items()})
        return out

    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=scheme.format, quantization_status="compressed")
    raw = json.loads(json.dumps(qc.model_dump(), default=str))
    return copy_checkpoint(src, f"ct-{preset}", transform=transform,
                           config_edit=lambda c: dict(c, quantization_config=raw))


@pytest.mark.parametrize("preset,fmt", [("MXFP4A16", "mxfp4"), ("NVFP4A16", "nvfp4"), ("MXFP8A16", "mxfp8"),
                                        ("FP8_DYNAMIC", "fp8"), ("FP8_BLOCK", "fp8")])
def test_compressed_tensors_checkpoint_loads(hf_dir, preset, fmt):
    path = ct_compress(hf_dir, preset)
    assert ModelConfig.from_dir(path).quant.weight_format == fmt
    got, model = logits(path)
    assert sum(isinstance(m, QuantizedWeight) for m in model.modules()) == 4
    want, _ = logits(dense_copy(path))
    assert rel_err(got, want) <= 1e-5
    assert_ct_reads_same(path, fmt)


# ---------------------------------------------------------------------------------------------------------------
# refusals: one line naming the tensor or the field

@pytest.fixture(scope="module")
def mxfp4_ckpt(hf_dir):
    out = scratch_dir("q-mx")
    quantize_checkpoint(hf_dir, out, "mxfp4")
    return out


@pytest.fixture(scope="module")
def nvfp4_modelopt(hf_dir):
    out = scratch_dir("q-mo")
    quantize_checkpoint(hf_dir, out, "nvfp4", layout="modelopt")
    return out


def load_error(path, exc=CheckpointError) -> str:
    with pytest.raises(exc) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


E = "model.layers.1.block_sparse_moe.experts.2.w1."


def without(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def changed(name, fn):
    return lambda t: dict(t, **{name: fn(t[name])})


@pytest.mark.parametrize("edit,words", [
    (without(E + "weight_scale"), ["missing", "experts.2.w1.weight_scale"]),
    (changed(E + "weight_scale", lambda v: v[:, :1]), [E + "weight_scale", "shape"]),
    (changed(E + "weight_scale", lambda v: v.float()), [E + "weight_scale", "dtype"]),
    (changed(E + "weight_packed", lambda v: v.view(torch.int8)), [E + "weight_packed", "dtype"]),
])
def test_bad_scales_are_refused_by_name(mxfp4_ckpt, edit, words):
    msg = load_error(copy_checkpoint(mxfp4_ckpt, "bad", transform=edit))
    assert all(w in msg for w in words), msg


@pytest.mark.parametrize("edit,words", [
    (without(E + "weight_scale_2"), ["missing", "experts.2.w1.weight_scale_2"]),
    (changed(E + "weight_scale_2", lambda v: torch.ones(2)), [E + "weight_scale_2", "shape"]),
    (changed(E + "weight_scale", lambda v: v.view(torch.uint8)), [E + "weight_scale", "dtype", "float8_e4m3fn"]),
])
def test_bad_modelopt_scales_are_refused_by_name(nvfp4_modelopt, edit, words):
    msg = load_error(copy_checkpoint(nvfp4_modelopt, "bad-mo", transform=edit))
    assert all(w in msg for w in words), msg


def test_optional_activation_scale_is_checked_when_present(nvfp4_modelopt):
    ok = copy_checkpoint(nvfp4_modelopt, "act", transform=lambda t: dict(t, **{E + "input_scale": torch.tensor(0.5)}))
    load_model(ok)
    bad = copy_checkpoint(nvfp4_modelopt, "act-bad",
                          transform=lambda t: dict(t, **{E + "input_scale": torch.ones(3)}))
    assert E + "input_scale" in load_error(bad)


def test_config_and_tensors_must_agree(mxfp4_ckpt, hf_dir):
    no_config = copy_checkpoint(mxfp4_ckpt, "nocfg",
                                config_edit=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    msg = load_error(no_config)
    assert "quantized weight" in msg and "does not quantize model.layers.1.block_sparse_moe.experts" in msg
    plain = copy_checkpoint(hf_dir, "claims", config_edit=lambda c: dict(
        c, quantization_config=json.load(open(os.path.join(mxfp4_ckpt, "config.json")))["quantization_config"]))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in load_error(plain)
    fp8 = copy_checkpoint(mxfp4_ckpt, "fp8-unclaimed", transform=lambda t: dict(
        t, **{"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"].to(
            torch.float8_e4m3fn)}))
    assert "q_proj.weight is stored as" in load_error(fp8)


def test_mixed_forms_in_one_stacked_weight_are_refused(mxfp4_ckpt):
    def edit(c):
        qc = c["quantization_config"]
        qc["ignore"] = ["model.layers.1.block_sparse_moe.experts.3.w2"]
        return c
    msg = load_error(copy_checkpoint(mxfp4_ckpt, "mixed", config_edit=edit))
    assert "experts.w2" in msg and "one form" in msg


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, ["weights.type", "'int'"]),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}, "config_groups": {}},
     ["kv_cache_scheme"]),
    ({"quant_method": "compressed-tensors", "quantization_status": "frozen", "config_groups": {}},
     ["quantization_status"]),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "format":
        "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}},
     ["mxfp4", "format"]),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, ["quant_algo", "W4A8_AWQ"]),
    ({"quant_method": "awq"}, ["quant_method", "awq"]),
])
def test_unsupported_schemes_are_one_line(qc, words):
    with pytest.raises(ConfigError) as ei:
        parse_quant(qc)
    msg = str(ei.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_compressed_tensors_preset_names_parse():
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    want = {"MXFP4A16": ("mxfp4", "group"), "MXFP4": ("mxfp4", "group"), "NVFP4A16": ("nvfp4", "group"),
            "NVFP4": ("nvfp4", "group"), "MXFP8A16": ("mxfp8", "group"), "FP8": ("fp8", "tensor"),
            "FP8_DYNAMIC": ("fp8", "channel"), "FP8_BLOCK": ("fp8", "block")}
    from compressed_tensors.compressors.format import infer_module_format
    for preset, (fmt, gran) in want.items():
        scheme = preset_name_to_scheme(preset, ["Linear"])
        scheme.format = infer_module_format(torch.nn.Linear, scheme)
        qc = QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"], format=scheme.format,
                                quantization_status="compressed")
        parsed = parse_quant(json.loads(json.dumps(qc.model_dump(), default=str)))
        assert (parsed.schemes[0].format, parsed.schemes[0].granularity) == (fmt, gran), preset
        assert parsed.scheme_for("model.layers.3.mlp.down_proj") and parsed.scheme_for("lm_head") is None


def test_modelopt_patterns_and_hf_quant_config(nvfp4_modelopt):
    q = parse_quant({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
                                                                  "exclude_modules": ["lm_head", "*.mlp.gate"]}})
    assert q.scheme_for("model.layers.3.mlp.gate") is None and q.scheme_for("model.layers.3.mlp.up_proj")
    only_json = copy_checkpoint(nvfp4_modelopt, "mo-json",
                                config_edit=lambda c: {k: v for k, v in c.items() if k != "quantization_config"})
    assert ModelConfig.from_dir(only_json).quant.layout == "modelopt"
    load_model(only_json)


# ---------------------------------------------------------------------------------------------------------------
# routing and the command

def test_router_keeps_quantized_checkpoints_off_bf16_targets(mxfp4_ckpt):
    from kestrel.models.kimi.routing import ModelingContext, check_claim, load_claim, route, target_names
    ctx = ModelingContext(config=ModelConfig.from_dir(mxfp4_ckpt), arch="sm_90", quant="bf16", kv_cache_dtype="bf16")
    assert ctx.weight_format == "mxfp4 experts"        # kestrel quantize's default: the routed experts only
    for name in target_names():
        check = next(c for c in check_claim(name, load_claim(name), ctx).checks if c.criterion == "quant")
        assert check.got == "mxfp4 experts" and check.ok == (load_claim(name)["quant"] == "mxfp4 experts")
    assert route(ctx, "auto")[0] is None      # a tiny model: the MXFP4 target's shape fingerprint misses


def test_quantize_command(hf_dir, capsys):
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="command"))
    out = scratch_dir("cli")
    args = ap.parse_args(["quantize", "--model", hf_dir, "--out", out, "--format", "nvfp4", "--modules", "all-linear"])
    assert args.func(args) == 0
    assert ModelConfig.from_dir(out).quant.weight_format == "nvfp4"
    assert capsys.readouterr().err == ""           # no progress bar off a terminal
    with pytest.raises(KestrelError, match="modelopt stores nvfp4 and fp8"):
        quantize_checkpoint(hf_dir, scratch_dir("x"), "mxfp4", layout="modelopt")
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, scratch_dir("y"), "fp8")


def test_modelopt_nvfp4_through_compressed_tensors_converter(nvfp4_modelopt):
    """compressed-tensors' ModelOpt -> compressed-tensors NVFP4 converter (it inverts weight_scale_2 into a global
    scale) accepts our ModelOpt files, and its decoder then agrees with ours to its bf16 rounding (a multiplier
    written as a divisor, or another nibble order, would be off by far more)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import preset_name_to_scheme
    q = ModelConfig.from_dir(nvfp4_modelopt).quant
    tensors = read_tensors(nvfp4_modelopt)
    converted = ModelOptNvfp4Converter(ignore=list(q.ignore), targets=[r"re:.*experts\.\d+\.w[123]$"]).validate(
        dict(tensors))
    ours = dequantized(nvfp4_modelopt)
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    modules = [n[:-len(".weight_packed")] for n in converted if n.endswith(".weight_packed")]
    assert len(modules) == 2 * 4 * 3
    for m in modules:
        sd = {k: converted[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(sd, scheme)["weight"].float()
        mine = ours[f"{m}.weight"]
        # their decoder rounds twice to bf16 here (the inverted scalar keeps the block scales in bf16): 2**-8 each
        assert ((theirs - mine).abs() <= mine.abs() * 2 ** -7).all(), m


def test_engine_serves_a_quantized_checkpoint(caplog):
    """The whole engine on a quantized checkpoint: `auto` routing falls back to the reference (one log line), and
    greedy decoding gives the tokens of the dequantized fp32 model."""
    import logging
    from kestrel import LLM, SamplingParams
    out = scratch_dir("q-llm")
    quantize_checkpoint(tiny_checkpoint("kimi-linear-tiny"), out, "nvfp4", "all-linear")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        got = LLM(model=out, device="cpu", kv_cache_tokens=256).generate([[5, 9, 2, 77]], params)[0]
    assert any("reference implementation" in r.getMessage() for r in caplog.records)
    want = LLM(model=dense_copy(out), device="cpu", kv_cache_tokens=256).generate([[5, 9, 2, 77]], params)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 8
