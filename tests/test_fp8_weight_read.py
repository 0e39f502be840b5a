"""`--fp8-weight-read moe-mlp` (kestrel/models/kimi/fp8_read.py): the MoE blocks' bf16 projections (shared experts;
K3's latent down / up) stored FP8 e4m3 per output channel at load.

Bounds. e4m3 keeps 3 mantissa bits: round to nearest moves a weight by at most 2^-4 of itself (a subnormal, under
2^-6 x its row's scale, by at most 2^-10 x that scale), so each converted GEMM's output moves by at most 2^-4 of
||W|| ||x|| (the rounding errors are independent: about 2^-4 / sqrt(3) ~ 0.036 norm-wise, 0.025 measured). The
converted GEMMs feed the residual stream beside the attention and the routed experts, so on tiny Kimi Linear the
logits move by less than that per GEMM (0.055 measured at most): bound 2 x 2^-4 on every position. Tiny K3 picks 16
of its experts per token with small gaps between their scores, and a perturbation of this size flips some picks
(2% multiplicative noise on the same weights moves its logits by up to 8%, FP8 up to 49% on one position), so
there the bound is on the median position. The targets also round the activations of those GEMMs to FP8 (W8A8:
Fp8QuantRows per token), one more rounding of at most 2^-4: the same bounds against the weight-only reference;
on Kimi Linear against a reference that rounds the same activations the same way, the fp32 summation order.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import scratch_dir
from helpers import single_thread  # noqa: F401  (autouse)
from test_targets import DEVICE, _forced_logits

from kestrel.catalog.quant.fp8_quant_rows import quantize_rows_reference
from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import ConfigError
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import make_checkpoint
from kestrel.models.kimi.fp8_read import apply_fp8_weight_read, convert_fp8_weight_read, moe_mlp_groups
from kestrel.models.kimi.reference import weight
from kestrel.models.kimi.weights import weights_nbytes
from kestrel.quant.tensors import QuantizedWeight

DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
ROUNDING = 2 ** -4
TARGETS = {"kimi-linear-tiny": "kimi_linear_bf16__sm_90__default", "k3-tiny": "kimi_k3_bf16__sm_90__default"}


@functools.cache
def _path(preset: str) -> str:
    return make_checkpoint(preset, os.path.join(scratch_dir("fp8read"), preset), layers=4, seed=5,
                           dtype=torch.float32, with_tokenizer=False)


def _load(preset: str, read: str = "none", dtype=torch.float32):
    path = _path(preset)
    config = ModelConfig.from_dir(path)
    model = load_reference_model(path, config, dtype, DEVICE)
    convert_fp8_weight_read(model, config, read)
    return config, model


def _stored(model, name: str):
    mod, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(mod), attr)


def _prompt(config, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()     # > MAX_VERIFY: prefill path
    return prompt, torch.randint(0, config.vocab_size, (4,), generator=gen).tolist()


def _err(got, want):
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def _check_bound(preset: str, err: torch.Tensor) -> None:
    if preset == "kimi-linear-tiny":
        assert err.max() < 2 * ROUNDING, err
    else:
        assert err.median() < 2 * ROUNDING and err.max() < 1, err


# ---- the flag -----------------------------------------------------------------------------------------------
def test_flag_values_are_checked_in_one_line(tmp_path):
    assert EngineConfig(model="unused").fp8_weight_read == "none"
    assert EngineConfig(model="unused", fp8_weight_read="moe-mlp").fp8_weight_read == "moe-mlp"
    for bad in ("fp8", "MOE-MLP", None, ""):
        with pytest.raises(ConfigError, match="--fp8-weight-read .*use one of none, moe-mlp") as e:
            EngineConfig(model="unused", fp8_weight_read=bad)
        assert "\n" not in str(e.value)
    from kestrel.cli import build_parser, engine_config
    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--model", str(tmp_path), "--fp8-weight-read", "moe-mlp"])
        assert engine_config(args).fp8_weight_read == "moe-mlp"
        args = build_parser().parse_args([*command, "--model", str(tmp_path), "--fp8-weight-read", "all"])
        with pytest.raises(ConfigError, match="--fp8-weight-read 'all'"):
            engine_config(args)
    from kestrel import LLM
    with pytest.raises(ConfigError, match="--fp8-weight-read 'yes'"):      # before the folder is even looked at
        LLM(model=str(tmp_path / "absent"), fp8_weight_read="yes")


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_conversion_rounds_each_weight_within_e4m3(preset):
    config, plain = _load(preset)
    _, model = _load(preset, "moe-mlp")
    groups = moe_mlp_groups(config)
    names = [n for g in groups for n in g]
    per_layer = 5 if config.routed_expert_hidden_size else 3      # + K3's latent down and up
    assert len(names) == per_layer * sum(map(config.is_moe_layer, range(config.num_layers)))
    for group in groups:
        for name in group:
            q, w = _stored(model, name), _stored(plain, name).float()
            assert isinstance(q, QuantizedWeight) and (q.format, q.granularity) == ("fp8", "channel")
            assert q.values.dtype == torch.float8_e4m3fn and q.scale.shape == (w.shape[0], 1)
            err = (weight(q).float() - w).abs()
            assert (err <= torch.maximum(w.abs() * ROUNDING, q.scale * 2 ** -10)).all(), name
            assert (err > 0).any()                                                   # it is lossy
        if len(group) > 1:       # K3's latent up | shared down: one GEMM along the inputs, one scale per row
            scales = [_stored(model, n).scale for n in group]
            assert all(torch.equal(s, scales[0]) for s in scales)
    # the rest is untouched
    quantized = {n.rpartition(".")[0] for n, _ in model.named_buffers()}
    assert quantized == set(names)


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_reference_logits_with_the_flag(preset):
    """Within the bound of the bf16 ones; equal to those of the model whose weights are the FP8-dequantized
    values (the same math: the reference dequantizes on the fly)."""
    config, plain = _load(preset)
    _, model = _load(preset, "moe-mlp")
    _, dequantized = _load(preset)
    with torch.no_grad():
        for name in (n for g in moe_mlp_groups(config) for n in g):
            dequantized.get_parameter(name).copy_(weight(_stored(model, name)))
    prompt, forced = _prompt(config)
    want = _forced_logits(plain, config, prompt, forced, torch.float32)
    got = _forced_logits(model, config, prompt, forced, torch.float32)
    _check_bound(preset, _err(got, want))
    assert _err(got, want).max() > 1e-4        # the weights did change
    same = _forced_logits(dequantized, config, prompt, forced, torch.float32)
    assert _err(got, same).max() < 1e-6


def _rounding_activations(model, config):
    """The reference with each converted projection's input rounded per token as Fp8QuantRows does (the targets'
    W8A8). Kimi Linear only: its converted GEMMs each see one whole input (K3's target joins two inputs)."""
    for name in (n for g in moe_mlp_groups(config) for n in g):
        linear = model.get_submodule(name.rpartition(".")[0])

        def forward(x, linear=linear):
            xq, scale = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
            return F.linear((xq.float() * scale).to(x.dtype).view(x.shape), weight(linear.weight))
        linear.forward = forward
    return model


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_target_with_the_flag_matches_the_reference(preset):
    config, oracle = _load(preset, "moe-mlp")
    prompt, forced = _prompt(config)
    want = _forced_logits(oracle, config, prompt, forced, torch.float32)
    _, base = _load(preset, "moe-mlp", DTYPE)
    target = importlib.import_module(f"kestrel.models.kimi.targets.{TARGETS[preset]}.modeling").build(base, config)
    moe = target.layers[1]
    assert isinstance(moe["x_in" if preset == "k3-tiny" else "shared_gu"], dict)      # the FP8 GEMM's arguments
    got = _forced_logits(target, config, prompt, forced, DTYPE)
    if DTYPE == torch.float32:
        _check_bound(preset, _err(got, want))
    else:
        # bf16 against the fp32 oracle: the bf16 targets' bound (tests/test_targets.py)
        assert _err(got, want).median() < 0.25, _err(got, want)
    if preset == "kimi-linear-tiny" and DTYPE == torch.float32:
        emulated = _forced_logits(_rounding_activations(oracle, config), config, prompt, forced, torch.float32)
        assert _err(got, emulated).max() < 1e-4, _err(got, emulated)


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_memory_plan_counts_the_fp8_weights(preset, caplog):
    config, model = _load(preset, "none", torch.bfloat16)
    plain = weights_nbytes(config, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kestrel"):
        apply_fp8_weight_read(model, config, "moe-mlp")
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert weights_nbytes(config, torch.bfloat16, fp8_weight_read="moe-mlp") == held < plain
    line = next(r.getMessage() for r in caplog.records if "--fp8-weight-read" in r.getMessage())
    n = sum(len(g) for g in moe_mlp_groups(config))
    assert line.startswith(f"--fp8-weight-read moe-mlp: {n} projections (shared experts")
    assert line.endswith(f", {(plain - held) / 2 ** 20:.1f} MiB saved")


def test_target_widths_with_the_flag_are_certified(monkeypatch):
    """contract.check_target_widths runs every target with the flag too: without the cells for the shared expert's
    FP8 GEMMs at Kimi Linear 48B's widths it names them."""
    from kestrel import contract
    from kestrel.catalog.quant.fp8_linear import Fp8Linear
    assert contract.check_target_widths(presets=("kimi-linear-48b",)) == [
        f"{t}: no real-width preset (kimi-linear-48b) routes to it" for t in
        ("kimi_k3_bf16__sm_90__default", "kimi_k3_mxfp4__sm_90__default", "kimi_k3_nvfp4__sm_90__default")]
    monkeypatch.setattr(Fp8Linear, "CELLS", tuple(c for c in Fp8Linear.CELLS if "--fp8-weight-read" not in c.why))
    problems = contract.check_target_widths(presets=("kimi-linear-48b",))
    flagged = [p for p in problems if "with --fp8-weight-read moe-mlp: quant.fp8_linear.Fp8Linear" in p]
    assert len(flagged) == 2 * 3, problems      # gate|up and down, in each of the three Kimi Linear targets
    assert any("K=2304, N=2048, granularity=channel" in p for p in flagged)
