"""Loading checkpoints: every spelling lands on the same parameters, every bad checkpoint is a one-line error
naming the cause, and the parts of K3 Kestrel does not serve (vision tower, projector, MTP layers) are skipped
with one log line per kind."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from helpers import PagedRequests, copy_checkpoint, load_model, prefill_all_logits, read_tensors, rel_err, \
    scratch_dir, tiny_checkpoint, write_tensors
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import LLM
from kestrel.errors import CheckpointError, ConfigError, KestrelError

P = "language_model.model."


@pytest.fixture(scope="module")
def k3():
    return tiny_checkpoint("k3-tiny")


@pytest.fixture(scope="module")
def k3_ref(k3):
    config, model = load_model(k3)
    ids = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    return ids, prefill_all_logits(model, config, ids)


def load_error(path: str, exc=CheckpointError) -> str:
    with pytest.raises(exc) as ei:
        load_model(path)
    msg = str(ei.value)
    assert "\n" not in msg, f"not one line: {msg!r}"
    return msg


def shard_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.mark.parametrize("keep", ["most", "header_part", "five_bytes"])
def test_truncated_shard(k3, keep):
    path = copy_checkpoint(k3, "trunc", num_shards=3)
    shard = shard_files(path)[1]
    size = os.path.getsize(shard)
    with open(shard, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    cut = {"most": size - 37, "header_part": 8 + header_len // 2, "five_bytes": 5}[keep]
    with open(shard, "r+b") as f:
        f.truncate(cut)
    msg = load_error(path)
    assert os.path.basename(shard) in msg and ("truncated" in msg or "corrupt" in msg)
    # the public API reports the same error
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(model=path, dtype="float32", device="cpu")


def test_missing_tensor(k3):
    gone = P + "layers.1.self_attn.q_proj.weight"
    path = copy_checkpoint(k3, "missing", transform=lambda t: {n: v for n, v in t.items() if n != gone})
    msg = load_error(path)
    assert "missing tensor layers.1.self_attn.q_proj.weight" in msg


def test_missing_expert_tensor_and_count(k3):
    gone = {P + "layers.2.block_sparse_moe.experts.3.w3.weight", P + "layers.4.self_attn.o_norm.weight"}
    path = copy_checkpoint(k3, "missing2", transform=lambda t: {n: v for n, v in t.items() if n not in gone})
    msg = load_error(path)
    assert "missing tensor" in msg and "and 1 more" in msg


def test_extra_tensor(k3):
    extra = P + "layers.0.self_attn.bogus_proj.weight"
    path = copy_checkpoint(k3, "extra", transform=lambda t: {**t, extra: torch.randn(4, 64)})
    msg = load_error(path)
    assert f"unexpected tensor {extra}" in msg and "[4, 64]" in msg


def test_extra_layer_tensor_in_dense_layer(k3):
    """An expert tensor in the dense layer 0 has no place."""
    extra = P + "layers.0.block_sparse_moe.experts.0.w1.weight"
    path = copy_checkpoint(k3, "extra2", transform=lambda t: {**t, extra: torch.randn(32, 32)})
    assert f"unexpected tensor {extra}" in load_error(path)


def test_wrong_shape(k3):
    name = P + "layers.2.self_attn.kv_b_proj.weight"

    def transform(t):
        t = dict(t)
        rows, cols = t[name].shape
        t[name] = torch.randn(rows, cols + 8)
        return t

    path = copy_checkpoint(k3, "shape", transform=transform)
    msg = load_error(path)
    assert name in msg and "[128, 40]" in msg and "[128, 32]" in msg


def test_duplicate_tensor_under_two_spellings(k3):
    name = P + "layers.0.mlp.gate_proj.weight"
    path = copy_checkpoint(k3, "dup", transform=lambda t: {**t, "model.layers.0.mlp.gate_proj.weight": t[name].clone()})
    assert "appears twice" in load_error(path)


def test_quantized_tensor_is_named(k3):
    path = copy_checkpoint(k3, "quant", transform=lambda t: {
        **t, P + "layers.2.block_sparse_moe.experts.0.w1.weight_scale": torch.ones(32, 2)})
    msg = load_error(path)
    assert "quantized" in msg and "weight_scale" in msg


def test_index_names_a_missing_shard(k3):
    path = copy_checkpoint(k3, "noshard", num_shards=3)
    os.remove(shard_files(path)[2])
    msg = load_error(path)
    assert "model-00003-of-00003.safetensors" in msg and "missing" in msg


def test_no_safetensors_at_all():
    path = scratch_dir("empty")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(__import__("kestrel.models.kimi.checkpoint", fromlist=["x"]).preset_config("k3-tiny"), f)
    assert "no *.safetensors" in load_error(path)


def test_unsupported_config_value(k3):
    def gelu(raw):
        raw["text_config"]["hidden_act"] = "gelu"
        return raw

    path = copy_checkpoint(k3, "gelu", config_edit=gelu)
    with pytest.raises(ConfigError) as ei:
        LLM(model=path, dtype="float32", device="cpu")
    assert "hidden_act" in str(ei.value) and "'gelu'" in str(ei.value) and "\n" not in str(ei.value)


def test_vision_projector_and_mtp_tensors_are_skipped_and_logged_once(k3, k3_ref, caplog):
    g = torch.Generator().manual_seed(5)
    n_layers = 6
    extra = {
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(48, 16, generator=g),
        "vision_tower.encoder.blocks.1.wqkv.weight": torch.randn(48, 16, generator=g),
        "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2, generator=g),
        "mm_projector.proj.0.weight": torch.randn(64, 16, generator=g),
        "mm_projector.proj.2.weight": torch.randn(64, 64, generator=g),
        f"{P}layers.{n_layers}.enorm.weight": torch.randn(64, generator=g),
        f"{P}layers.{n_layers}.hnorm.weight": torch.randn(64, generator=g),
        f"{P}layers.{n_layers}.eh_proj.weight": torch.randn(64, 128, generator=g),
    }
    path = copy_checkpoint(k3, "vision", transform=lambda t: {**t, **extra}, num_shards=3)
    caplog.set_level(logging.INFO, logger="kestrel.weights")
    config, model = load_model(path)
    ids, ref = k3_ref
    assert torch.equal(prefill_all_logits(model, config, ids), ref)
    skip_lines = [r.getMessage() for r in caplog.records if r.name == "kestrel.weights" and "skipped" in r.getMessage()]
    assert len(skip_lines) == 2, skip_lines              # one line per kind, not one per tensor
    vision = [m for m in skip_lines if "vision" in m]
    mtp = [m for m in skip_lines if "MTP" in m]
    assert len(vision) == 1 and "5" in vision[0]
    assert len(mtp) == 1 and "3" in mtp[0]


def test_attn_res_underscore_spelling_loads_the_same(k3, k3_ref):
    """Some K3 checkpoints write `self_attention_res.proj_weight` / `.norm_weight`."""
    def respell(t):
        out = {}
        for n, v in t.items():
            for r in ("self_attention_res", "mlp_res", "output_attn_res"):
                n = n.replace(f"{r}_proj.weight", f"{r}.proj_weight").replace(f"{r}_norm.weight", f"{r}.norm_weight")
            out[n] = v
        return out

    path = copy_checkpoint(k3, "respell", transform=respell)
    assert any(".proj_weight" in n for n in read_tensors(path))
    config, model = load_model(path)
    ids, ref = k3_ref
    assert torch.equal(prefill_all_logits(model, config, ids), ref)


def test_model_prefix_and_unsharded_file_load_the_same(k3, k3_ref):
    """`model.` instead of `language_model.model.`, one file without an index."""
    path = scratch_dir("plain")
    for fn in os.listdir(k3):
        if fn == "config.json":
            with open(os.path.join(k3, fn)) as f, open(os.path.join(path, fn), "w") as g:
                g.write(f.read())
    t = {n.replace("language_model.", ""): v for n, v in read_tensors(k3).items()}
    write_tensors(path, t, num_shards=1, index=False)
    config, model = load_model(path)
    ids, ref = k3_ref
    assert torch.equal(prefill_all_logits(model, config, ids), ref)


def test_bf16_load_keeps_decay_and_router_bias_fp32(k3):
    config, model = load_model(k3, dtype=torch.bfloat16)
    kda = model.layers[config.kda_layers[0]].self_attn
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == torch.float32 and kda.dt_bias.dtype == torch.float32
    assert model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    _, model32 = load_model(k3)
    cache = PagedRequests(config, 1, 8, seed=9, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (8,), generator=torch.Generator().manual_seed(10)).tolist()
    out = model(cache.batch([(0, ids, 0, 8)]), cache.pools)
    ref = prefill_all_logits(model32, config, ids)
    # bf16 noise flips an occasional routing decision of a random model (a jump in that row's logits), so compare
    # the direction of the typical row
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and cos.median() > 0.99


def test_errors_are_kestrel_errors():
    assert issubclass(CheckpointError, KestrelError) and issubclass(ConfigError, KestrelError)


def test_kimi_linear_layer_past_the_config_is_unexpected():
    """Kimi Linear has no MTP layers: a layer beyond num_hidden_layers means config and checkpoint disagree."""
    src = tiny_checkpoint("kimi-linear-tiny")
    extra = "model.layers.4.input_layernorm.weight"
    path = copy_checkpoint(src, "kl-extra-layer", transform=lambda t: {**t, extra: torch.ones(64)})
    assert f"unexpected tensor {extra}" in load_error(path)


def test_kimi_linear_checkpoint_with_fewer_layers_in_config_is_an_error():
    src = tiny_checkpoint("kimi-linear-tiny")

    def three_layers(raw):
        raw["num_hidden_layers"] = 3
        raw["linear_attn_config"].update(full_attn_layers=[2], kda_layers=[1, 3])
        return raw

    path = copy_checkpoint(src, "kl-cut", config_edit=three_layers, num_shards=1)
    assert "unexpected tensor model.layers.3." in load_error(path)
