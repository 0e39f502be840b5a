"""Parity with HF transformers 5.23 `KimiLinearForCausalLM` on tiny random models.

For each config: HF's save_pretrained output and a Moonshot-named, sharded copy both load into Kestrel's reference
model, give identical logits, match HF's fp32 prefill logits within 1e-4 (relative to max |logit|), and
`kestrel.LLM(...).generate` at temperature 0 reproduces HF's argmax at every generated position.
"""

from __future__ import annotations

import pytest
import torch

from helpers import copy_checkpoint, hf_model, load_model, moonshot_rename, prefill_all_logits, read_tensors, \
    rel_err, save_hf
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel import LLM, SamplingParams

BASE = dict(vocab_size=256, rms_norm_eps=1e-5, routed_scaling_factor=2.446, linear_conv_kernel_dim=4)

CONFIGS = {
    # KDA first, 1 dense layer, 1 shared expert, one expert group; a 70-token prompt crosses HF's 64-token KDA chunk
    "kda_first": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                            "short_conv_kernel_size": 4},
        prompt_len=70),
    # MLA first, 2 dense layers, 2 shared experts, 2 expert groups of which 1 is kept
    "mla_first_grouped": dict(
        hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=8, num_local_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=2, topk_group=1,
        first_k_dense_replace=2, routed_scaling_factor=1.0,
        linear_attn_config={"full_attn_layers": [1, 4], "kda_layers": [2, 3], "head_dim": 8, "num_heads": 3,
                            "short_conv_kernel_size": 4},
        prompt_len=21),
    # KDA first, wider, q LoRA, 12 experts in 4 groups (2 kept), top-4, 2 dense layers
    "kda_first_wide_q_lora": dict(
        hidden_size=96, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=40, kv_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, num_local_experts=12, num_experts_per_tok=4, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=2, routed_scaling_factor=1.7,
        linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2, 4, 5], "head_dim": 16, "num_heads": 4,
                            "short_conv_kernel_size": 4},
        prompt_len=17),
    # MLA first, narrow, 6 experts in 3 groups (2 kept), 2 shared experts, 1 dense layer; a large rms_norm_eps
    # shows any norm that uses the wrong epsilon
    "mla_first_narrow": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
        qk_nope_head_dim=12, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=2, n_group=3,
        topk_group=2, first_k_dense_replace=1, rms_norm_eps=0.05,
        linear_attn_config={"full_attn_layers": [1], "kda_layers": [2, 3], "head_dim": 8, "num_heads": 4,
                            "short_conv_kernel_size": 4},
        prompt_len=25),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    name = request.param
    spec = dict(CONFIGS[name])
    prompt_len = spec.pop("prompt_len")
    seed = sorted(CONFIGS).index(name) + 11
    model = hf_model(seed, **{**BASE, **spec})
    hf_dir = save_hf(model, f"hf-{name}")
    dense = list(range(spec["first_k_dense_replace"]))
    moon_dir = copy_checkpoint(hf_dir, f"moonshot-{name}", transform=lambda t: moonshot_rename(t, dense),
                               num_shards=3)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, BASE["vocab_size"], (prompt_len,), generator=g).tolist()
    return dict(name=name, hf=model, hf_dir=hf_dir, moon_dir=moon_dir, prompt=prompt, dense=dense)


def test_checkpoint_spellings_differ_as_intended(case):
    """The two copies really use the two spellings of the dense FFN (else the next test proves nothing)."""
    hf_names, moon_names = set(read_tensors(case["hf_dir"])), set(read_tensors(case["moon_dir"]))
    for i in case["dense"]:
        assert f"model.layers.{i}.block_sparse_moe.gate_proj.weight" in hf_names
        assert f"model.layers.{i}.mlp.gate_proj.weight" in moon_names
        assert not any(n.startswith(f"model.layers.{i}.block_sparse_moe.") for n in moon_names)
    assert any(n.endswith("e_score_correction_bias") for n in hf_names)


def test_prefill_logits_match_hf(case):
    ids = case["prompt"]
    with torch.no_grad():
        ref = case["hf"](torch.tensor([ids]), use_cache=False).logits[0]
    config, model = load_model(case["hf_dir"])
    out = prefill_all_logits(model, config, ids)
    assert out.shape == ref.shape
    err = rel_err(out, ref)
    assert err < 1e-4, f"{case['name']}: prefill logits differ from HF by {err:.2e} (relative to max |logit|)"

    # the Moonshot-named, sharded copy loads to the very same weights
    config2, model2 = load_model(case["moon_dir"])
    assert config2 == config
    out2 = prefill_all_logits(model2, config2, ids)
    assert torch.equal(out, out2), f"{case['name']}: HF-named and Moonshot-named copies give different logits"


def test_router_bias_matters(case):
    """The random e_score_correction_bias changes HF's routing, so the parity above really covers it."""
    ids = torch.tensor([case["prompt"]])
    hf = case["hf"]
    biases = {n: b.clone() for n, b in hf.named_buffers() if "e_score_correction_bias" in n}
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits[0]
        try:
            for n, b in hf.named_buffers():
                if n in biases:
                    b.zero_()
            unbiased = hf(ids, use_cache=False).logits[0]
        finally:
            for n, b in hf.named_buffers():
                if n in biases:
                    b.copy_(biases[n])
    assert rel_err(unbiased, ref) > 1e-3


def test_greedy_continuation_matches_hf_argmax(case):
    prompt = case["prompt"]
    llm = LLM(model=case["moon_dir"], dtype="float32", device="cpu")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert len(out) == 1
    gen = out[0].token_ids
    assert len(gen) == 32 and out[0].finish_reason == "length"
    assert len(set(gen)) >= 4, f"degenerate continuation {gen}: the test would prove little"
    hf = case["hf"]
    checked = 0
    with torch.no_grad():
        for j in range(32):
            logits = hf(torch.tensor([prompt + gen[:j]]), use_cache=False).logits[0, -1]
            top2 = logits.topk(2).values
            if (top2[0] - top2[1]).item() < 1e-4:
                continue
            assert gen[j] == int(logits.argmax()), (
                f"{case['name']}: generated token {j} is {gen[j]}, HF's argmax is {int(logits.argmax())}")
            checked += 1
    assert checked >= 28


def test_hf_native_config_form_matches_hf():
    """A model HF built from `layer_types` / `mlp_layer_types` / `linear_*` (no linear_attn_config, no
    first_k_dense_replace in its config.json) loads and matches HF too."""
    spec = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
                qk_nope_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                layer_types=["linear_attention", "linear_attention", "full_attention"],
                mlp_layer_types=["dense", "dense", "sparse"], linear_num_heads=2, linear_head_dim=8)
    model = hf_model(5, **{**BASE, **spec})
    d = save_hf(model, "hf-native")
    import json, os
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    assert not raw.get("linear_attn_config") and "first_k_dense_replace" not in raw
    ids = torch.randint(3, BASE["vocab_size"], (19,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=False).logits[0]
    config, km = load_model(d)
    assert config.first_k_dense_replace == 2 and config.kda_head_dim == 8
    assert rel_err(prefill_all_logits(km, config, ids), ref) < 1e-4


FAKE_FLA = '''
def _refuse(*args, **kwargs):
    raise RuntimeError("fla kernel called")
chunk_kda = fused_recurrent_kda = _refuse
'''

HF_WITH_FLA = '''
import sys, torch
import fla                                    # the stand-in above: importable, so HF binds its kernels
from transformers.models.kimi_linear import modeling_kimi_linear as hf
try:                                          # without force_hf_torch_kda, HF's chunk call would reach fla
    hf.chunk_kimi_delta_attention(*[torch.zeros(1)] * 5)
    sys.exit("HF did not bind the stand-in fla kernel: this test no longer tests anything")
except RuntimeError as e:
    assert "fla kernel called" in str(e), e
from helpers import hf_model
model = hf_model(3, vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                 qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1,
                 linear_attn_config={"full_attn_layers": [2], "kda_layers": [1], "head_dim": 8, "num_heads": 2,
                                     "short_conv_kernel_size": 4})
with torch.no_grad():
    out = model(torch.arange(1, 10)[None], use_cache=True)
    model(torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)
print("torch path")
'''


def test_hf_models_take_the_torch_kda_path_even_with_fla_importable(tmp_path):
    """An `fla` that imports but whose kernels raise: HF's module binds them, hf_model's models must not call them
    (prefill through chunk, decode through the recurrent step)."""
    import os
    import subprocess
    import sys

    from helpers import REPO
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text(FAKE_FLA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(REPO, "tests"), REPO,
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", HF_WITH_FLA], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "torch path" in run.stdout, run.stderr[-3000:]
