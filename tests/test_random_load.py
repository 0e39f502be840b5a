"""`--load-format random`: seeded trained-like weights drawn in place on the device from a folder that holds only
config.json. On the CPU they equal what `make-checkpoint` writes for the same seed and dtype (one init rule for
both); the same seed gives the same weights, another seed others; the model runs and looks trained-like (weight
scales, decay ranges, a router that spreads tokens over the experts)."""

from __future__ import annotations

import os
import resource
import time

import pytest
import torch

from helpers import load_model, prefill_all_logits, scratch_dir, tiny_checkpoint
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import LLM, SamplingParams
from kestrel.config import ModelConfig
from kestrel.errors import CheckpointError
from kestrel.models.kimi.checkpoint import make_checkpoint, preset_config, random_reference_model
from kestrel.models.kimi.reference import rms_norm
from kestrel.models.kimi.weights import expected_tensors, weights_nbytes

PRESETS = ["kimi-linear-tiny", "k3-tiny"]
CPU = torch.device("cpu")


def config_only(preset: str, layers: int | None = None) -> str:
    out = os.path.join(scratch_dir(f"cfg-{preset}"), "model")
    make_checkpoint(preset, out, layers=layers, config_only=True)
    return out


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_random_load_equals_make_checkpoint(preset, dtype):
    """The same function draws both: loading the checkpoint make-checkpoint wrote gives the very same tensors."""
    if dtype == torch.float32:
        path = tiny_checkpoint(preset)                       # seed 0, fp32
    else:
        path = os.path.join(scratch_dir("bf16"), "m")
        make_checkpoint(preset, path, seed=0, dtype=dtype, with_tokenizer=False)
    config, loaded = load_model(path, dtype)
    drawn = random_reference_model(config, dtype, CPU, seed=0)
    assert_same_params(drawn, loaded)


@pytest.mark.parametrize("preset", PRESETS)
def test_make_checkpoint_writes_a_given_models_weights(preset):
    """make_checkpoint(config=, weights=): an edited config (here: more layers, every one KDA but the last) and a
    model's own parameters (seed 3's, perturbed per tensor: no rule draws these) are what loading gives back."""
    raw = preset_config(preset, layers=3)
    lin = raw.get("text_config", raw)["linear_attn_config"]
    lin["full_attn_layers"], lin["kda_layers"] = [3], [1, 2]
    config = ModelConfig.from_dict(raw)
    model = random_reference_model(config, torch.float32, CPU, seed=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    path = os.path.join(scratch_dir("weights"), "m")
    make_checkpoint(preset, path, config=raw, weights=model, dtype=torch.float32, with_tokenizer=False)
    loaded_config, loaded = load_model(path, torch.float32)
    assert loaded_config.layer_kinds == config.layer_kinds
    assert_same_params(model, loaded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_nbytes_is_what_the_model_holds(dtype):
    """The memory check before loading counts the same bytes the parameters then take."""
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    model = random_reference_model(config, dtype, CPU, seed=0)
    assert weights_nbytes(config, dtype) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_same_seed_same_weights_other_seed_others():
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    a = random_reference_model(config, torch.float32, CPU, seed=7)
    b = random_reference_model(config, torch.float32, CPU, seed=7)
    c = random_reference_model(config, torch.float32, CPU, seed=8)
    assert_same_params(a, b)
    for (name, pa), (_, pc) in zip(a.named_parameters(), c.named_parameters()):
        assert not torch.equal(pa, pc), f"{name} does not depend on the seed"


def check_trained_like(model, config: ModelConfig) -> None:
    """Shapes and dtypes as the checkpoint table says; scales as make-checkpoint promises."""
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values()), "a parameter was left on the meta device"
    table = expected_tensors(config)
    placed = {place.param for place in table.values()}
    assert placed == set(params), "the random load must fill every parameter and only those"
    for name, place in table.items():
        if place.index is None and place.rows is None:
            assert params[place.param].numel() == torch.Size(place.shape).numel(), name
    for name, p in params.items():
        p = p.float()
        if name.endswith("A_log"):
            lo, hi = (1.0, 16.0) if config.gate_lower_bound is None else (0.5, 2.0)
            assert p.exp().min() >= lo * 0.999 and p.exp().max() <= hi * 1.001, name
            assert params[name].dtype == torch.float32
        elif name.endswith("dt_bias"):
            assert p.min() >= -5.0 and p.max() <= -1.0 and params[name].dtype == torch.float32, name
        elif name.endswith("e_score_correction_bias"):
            assert params[name].dtype == torch.float32 and 0.005 < p.std() < 0.05, name
        elif name.endswith("norm") or "layernorm" in name or name.endswith("_norm"):
            assert abs(p.mean() - 1) < 0.05 and p.std() < 0.1, name
        elif name == "embed_tokens":
            assert abs(p.std() - 1) < 0.05, name
        elif name.endswith("experts.w13"):                   # [E, 2I, width]: fan-in is the width
            assert abs(p.std() * p.shape[-1] ** 0.5 - 1) < 0.1, name
        elif name.endswith("experts.w2"):                    # [E, width, I]
            assert abs(p.std() * p.shape[-1] ** 0.5 - 1) < 0.1, name
        elif p.dim() == 2 and p.numel() >= 1024:
            assert abs(p.std() * p.shape[1] ** 0.5 - 1) < 0.1, name


def router_spread(model, config: ModelConfig, num_tokens: int = 64) -> int:
    """Experts the first MoE layer's router picks for random tokens (top-k of sigmoid scores + bias)."""
    i = next(i for i in range(config.num_layers) if config.is_moe_layer(i))
    gate = model.layers[i].block_sparse_moe.gate
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    x = rms_norm(model.embed_tokens[ids].float(), model.layers[i].post_attention_layernorm.float(), 1e-5)
    scores = torch.sigmoid(x @ gate.weight.float().t()) + gate.e_score_correction_bias
    return len(set(scores.topk(config.num_experts_per_tok, dim=-1).indices.flatten().tolist()))


@pytest.mark.parametrize("preset", PRESETS)
def test_random_model_runs_and_is_trained_like(preset):
    config = ModelConfig.from_dict(preset_config(preset))
    model = random_reference_model(config, torch.float32, CPU, seed=3)
    check_trained_like(model, config)
    assert router_spread(model, config) >= config.num_experts - 1
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = prefill_all_logits(model, config, ids)
    assert logits.shape == (12, config.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.1 and len(set(logits.argmax(-1).tolist())) > 3, "degenerate logits"


def test_llm_random_from_config_only_folder():
    """A folder with config.json and the tokenizer only: random works (and on the CPU generates what the written
    checkpoint of the same seed generates); auto fails naming --load-format random."""
    path = config_only("k3-tiny")
    assert sorted(os.listdir(path)) == ["config.json", "tiktoken.model", "tokenizer_config.json"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = LLM(model=path, dtype="float32", device="cpu", load_format="random").generate("Hello", params)[0]
    ref = LLM(model=tiny_checkpoint("k3-tiny"), dtype="float32", device="cpu").generate("Hello", params)[0]
    assert out.token_ids == ref.token_ids
    with pytest.raises(CheckpointError, match="--load-format random") as ei:
        LLM(model=path, dtype="float32", device="cpu")
    assert "no *.safetensors" in str(ei.value) and "\n" not in str(ei.value)


# ---------------------------------------------------------------------------------------------------------------
# on a GPU (skipped without one): drawn on the device, same seed same weights, real widths fast

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_random_load_is_seeded_and_trained_like():
    config = ModelConfig.from_dict(preset_config("k3-tiny"))
    dev = torch.device("cuda")
    a = random_reference_model(config, torch.bfloat16, dev, seed=5)
    b = random_reference_model(config, torch.bfloat16, dev, seed=5)
    assert_same_params(a, b)
    assert all(p.device.type == "cuda" for p in a.parameters())
    check_trained_like(a, config)
    assert router_spread(a, config) >= config.num_experts - 1


@needs_cuda
def test_cuda_kimi_linear_48b_random_load_is_fast():
    """The whole 27-layer Kimi Linear 48B (~96 GB bf16) where the GPU holds it, else 4 of its layers: drawn on the
    GPU in well under a minute, nothing staged in host memory."""
    free, _ = torch.cuda.mem_get_info()
    layers = None if free > 110 * 2 ** 30 else 4
    config = ModelConfig.from_dict(preset_config("kimi-linear-48b", layers))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = random_reference_model(config, torch.bfloat16, torch.device("cuda"), seed=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    print(f"kimi-linear-48b ({config.num_layers} layers): {nbytes / 1e9:.1f} GB in {seconds:.1f} s "
          f"({nbytes / 1e9 / seconds:.0f} GB/s), host RSS +{rss_growth / 2 ** 30:.2f} GiB")
    assert seconds < (45 if layers is None else 15)
    assert rss_growth < 2 * 2 ** 30, "weights were staged in host memory"
    w = model.layers[1].block_sparse_moe.experts.w13
    assert abs(w[:4].float().std().item() * w.shape[-1] ** 0.5 - 1) < 0.05
    del model
    torch.cuda.empty_cache()
