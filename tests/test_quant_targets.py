"""The quantized sm_90 targets: FP4 routed experts through W4A16GroupedGemm, the rest as in the bf16 targets.

Each target's teacher-forced logits equal the reference model's on the same quantized checkpoint (tiny, 4 layers:
KDA + dense, two KDA + MoE, MLA + MoE; a 10-token prefill runs the prefill MoE path, the decode steps the
small-batch one); the router picks the target by the weight format and declines a bf16 KDA state, other formats
and checkpoints that quantize more than the experts (quantized pages route: test_kv_quant_targets.py);
`--load-format random` of a quantized config equals quantizing the weights make-checkpoint writes. On the CPU
everything runs in fp32 (the Triton interpreter), so the bound is fp32 summation order; on a GPU in bf16, within
the bf16 targets' bound."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from helpers import load_model, scratch_dir
from helpers import single_thread  # noqa: F401  (autouse)
from test_targets import _forced_logits

from kestrel import contract
from kestrel.config import ModelConfig
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import make_checkpoint, random_reference_model
from kestrel.models.kimi.routing import ModelingContext, explain, route
from kestrel.models.kimi.weights import weights_nbytes
from kestrel.quant.quantize import quantize_checkpoint
from kestrel.quant.tensors import QuantizedWeight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
CPU = torch.device("cpu")

# (tiny preset, routed-expert format, checkpoint layout, the target the real-width model routes to)
CASES = [("kimi-linear-tiny", "nvfp4", "compressed-tensors", "kimi_linear_nvfp4__sm_90__default"),
         ("kimi-linear-tiny", "mxfp4", "compressed-tensors", "kimi_linear_mxfp4__sm_90__default"),
         ("k3-tiny", "mxfp4", "compressed-tensors", "kimi_k3_mxfp4__sm_90__default"),
         ("k3-tiny", "nvfp4", "modelopt", "kimi_k3_nvfp4__sm_90__default")]


@pytest.mark.parametrize("preset, fmt, layout, target", CASES)
def test_quantized_target_matches_the_reference(preset, fmt, layout, target):
    path = make_checkpoint(preset, os.path.join(scratch_dir(f"qt-{fmt}"), preset), layers=4, seed=5,
                           dtype=torch.float32, with_tokenizer=False, quant=fmt, quant_layout=layout)
    config = ModelConfig.from_dir(path)
    oracle = load_reference_model(path, config, torch.float32, DEVICE)
    w13 = oracle.get_submodule("layers.1.block_sparse_moe.experts.w13")
    assert isinstance(w13, QuantizedWeight) and w13.format == fmt
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (10,), generator=gen).tolist()    # > MAX_VERIFY: prefill path
    forced = torch.randint(0, config.vocab_size, (4,), generator=gen).tolist()     # 3 decode steps
    want = _forced_logits(oracle, config, prompt, forced, torch.float32)
    base = oracle if DTYPE == torch.float32 else load_reference_model(path, config, DTYPE, DEVICE)
    model = importlib.import_module(f"kestrel.models.kimi.targets.{target}.modeling").build(base, config)
    got = _forced_logits(model, config, prompt, forced, DTYPE)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    if DTYPE == torch.float32:
        # the same dequantized weights (exact in bf16) in another summation order
        assert err.max() < 1e-4, err
    else:
        # bf16 against the fp32 oracle: the bf16 targets' bound (tests/test_targets.py)
        assert err.median() < 0.25, err


def _ctx(preset: str, quant: str, kv: str = "bf16", layers: int = 2) -> ModelingContext:
    return ModelingContext(config=contract.claimed_config(preset, {"quant": quant}, layers), arch="sm_90",
                           quant="bf16", kv_cache_dtype=kv)


def test_router_picks_the_quantized_target_by_weight_format():
    for preset, quant, want in (("k3", "mxfp4 experts", "kimi_k3_mxfp4__sm_90__default"),
                                ("k3", "nvfp4 experts", "kimi_k3_nvfp4__sm_90__default"),
                                ("k3", "bf16", "kimi_k3_bf16__sm_90__default"),
                                ("kimi-linear-48b", "nvfp4 experts", "kimi_linear_nvfp4__sm_90__default"),
                                ("kimi-linear-48b", "mxfp4 experts", "kimi_linear_mxfp4__sm_90__default"),
                                ("kimi-linear-48b", "bf16", "kimi_linear_bf16__sm_90__default")):
        ctx = _ctx(preset, quant)
        assert ctx.weight_format == quant
        assert route(ctx, "require")[0] == want, (preset, quant)
    text = explain(_ctx("k3", "mxfp4 experts"))
    assert "ok   quant: wanted mxfp4 experts, got mxfp4 experts" in text
    assert "MISS quant: wanted nvfp4 experts, got mxfp4 experts" in text
    assert "decision: target kimi_k3_mxfp4__sm_90__default" in text
    text = explain(_ctx("kimi-linear-48b", "mxfp4 experts"))
    assert "target kimi_linear_mxfp4__sm_90__default: CLAIMS" in text
    assert "target kimi_linear_nvfp4__sm_90__default: declines" in text
    assert "decision: target kimi_linear_mxfp4__sm_90__default" in text


@pytest.mark.parametrize("preset, quant, kv", [
    ("k3", "mxfp4 experts", "bf16+kda-bf16"),       # a bf16 KDA state: the targets' KDA kernels keep fp32
    ("k3", "mxfp4 experts", "fp8+kda-bf16"),
    ("k3", "mxfp8 experts", "bf16"),                # a format no target claims
    ("k3", "nvfp4", "bf16"),                        # --modules all-linear: the trunk is quantized too
    ("kimi-linear-48b", "mxfp8 experts", "bf16"),   # Kimi Linear's FP4 targets: MXFP4 and NVFP4 only
    ("kimi-linear-48b", "mxfp4", "bf16"),           # all-linear MXFP4: no target reads a quantized trunk
])
def test_router_declines_other_formats_and_pages(preset, quant, kv):
    ctx = _ctx(preset, quant, kv)
    assert route(ctx, "auto")[0] is None
    assert ctx.weight_format == quant


@pytest.mark.parametrize("preset, fmt, layout", [(p, f, lay) for p, f, lay, _ in CASES])
def test_random_quantized_load_equals_quantizing_make_checkpoint(preset, fmt, layout):
    """Drawn in place and quantized tensor by tensor = make-checkpoint's weights through `kestrel quantize`, bit
    for bit, and the config make-checkpoint --quant writes is the one kestrel quantize writes."""
    root = scratch_dir(f"qrand-{fmt}-{layout}")
    plain = make_checkpoint(preset, os.path.join(root, "plain"), layers=4, seed=2, dtype=torch.bfloat16,
                            with_tokenizer=False)
    quantized = os.path.join(root, "quantized")
    qc = quantize_checkpoint(plain, quantized, fmt, "experts", layout, progress=False)
    folder = make_checkpoint(preset, os.path.join(root, "config"), layers=4, config_only=True,
                             with_tokenizer=False, quant=fmt, quant_layout=layout)
    with open(os.path.join(folder, "config.json")) as f:
        written = json.load(f)["quantization_config"]
    assert written == json.loads(json.dumps(qc))
    config, loaded = load_model(quantized, torch.bfloat16)
    drawn = random_reference_model(ModelConfig.from_dir(folder), torch.bfloat16, CPU, seed=2)
    a, b = dict(loaded.state_dict()), dict(drawn.state_dict())
    assert a.keys() == b.keys() and any(k.endswith("experts.w13.values") for k in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    held = sum(t.numel() * t.element_size() for t in b.values())
    assert weights_nbytes(config, torch.bfloat16) == held


def test_make_checkpoint_with_quantized_experts_loads_as_written():
    """make-checkpoint --quant writes the quantized tensors itself; loading them equals the random load."""
    path = make_checkpoint("k3-tiny", os.path.join(scratch_dir("qmake"), "m"), layers=2, seed=4,
                           dtype=torch.float32, with_tokenizer=False, quant="mxfp4")
    config, loaded = load_model(path)
    drawn = random_reference_model(config, torch.float32, CPU, seed=4)
    a, b = loaded.state_dict(), drawn.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flags", [{"tensor_parallel_size": 2},
                                   {"data_parallel_size": 2, "enable_expert_parallel": True}])
def test_random_quantized_load_of_one_rank_equals_its_loaded_slice(flags):
    """A rank's random quantized weights are its slice of the whole quantized tensors (drawn whole, quantized,
    sliced), as the loader reads them from the checkpoint."""
    from kestrel.config import EngineConfig
    from kestrel.parallel.mapping import Mapping
    path = make_checkpoint("kimi-linear-tiny", os.path.join(scratch_dir("qrank"), "m"), layers=2, seed=3,
                           dtype=torch.float32, with_tokenizer=False, quant="nvfp4")
    config = ModelConfig.from_dir(path)
    m = Mapping.from_engine_config(EngineConfig(model=path, **flags), 1)
    loaded = load_reference_model(path, config, torch.float32, CPU, m).state_dict()
    drawn = random_reference_model(config, torch.float32, CPU, 3, m).state_dict()
    assert loaded.keys() == drawn.keys()
    assert all(torch.equal(loaded[k], drawn[k]) for k in loaded)
