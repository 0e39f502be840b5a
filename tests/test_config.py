"""ModelConfig parsing: both model types, Moonshot field names and HF aliases, 1-based layer lists, and a one-line
ConfigError naming the field and the value for everything Kestrel cannot run."""

from __future__ import annotations

import copy
import json
import os

import pytest

from helpers import scratch_dir
from helpers import single_thread  # noqa: F401  (autouse)

from kestrel.config import ARCH_KIMI_K3, ARCH_KIMI_LINEAR, KDA, MLA, ModelConfig
from kestrel.errors import ConfigError
from kestrel.models.kimi.checkpoint import preset_config


def kl_tiny() -> dict:
    return preset_config("kimi-linear-tiny")


def k3_tiny() -> dict:
    return preset_config("k3-tiny")


def test_kimi_linear_48b_facts():
    c = ModelConfig.from_dict(preset_config("kimi-linear-48b"))
    assert c.arch == ARCH_KIMI_LINEAR
    assert c.num_layers == 27
    assert [i + 1 for i in c.mla_layers] == [4, 8, 12, 16, 20, 24, 27]
    assert len(c.kda_layers) == 20
    assert c.q_lora_rank is None and c.kv_lora_rank == 512 and c.mla_cache_width == 576
    assert c.softmax_scale == pytest.approx((128 + 64) ** -0.5)
    assert (c.num_experts, c.num_experts_per_tok, c.n_shared_experts) == (256, 8, 1)
    assert c.routed_scaling_factor == pytest.approx(2.446)
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 27))
    assert c.gate_lower_bound is None and not c.kda_full_rank_output_gate
    assert c.hidden_act == "silu" and c.routed_expert_hidden_size is None and c.attn_res_block_size == 0
    assert not c.mla_use_output_gate
    assert c.max_position_embeddings == 1048576
    assert c.eos_token_ids == (163585,)


def test_k3_facts():
    raw = preset_config("k3")
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"] and "text_config" in raw
    c = ModelConfig.from_dict(raw)
    assert c.arch == ARCH_KIMI_K3
    assert c.num_layers == 93 and c.hidden_size == 7168
    assert [i + 1 for i in c.mla_layers] == list(range(4, 93, 4)) + [93]
    assert len(c.mla_layers) == 24 and len(c.kda_layers) == 69
    assert c.q_lora_rank == 1536 and c.mla_cache_width == 576 and c.mla_use_output_gate
    assert c.softmax_scale == pytest.approx(192 ** -0.5)
    assert (c.num_experts, c.num_experts_per_tok, c.n_shared_experts) == (896, 16, 2)
    assert c.routed_expert_hidden_size == 3584 and c.latent_moe_use_norm
    assert c.hidden_act == "situ" and (c.situ_beta, c.situ_linear_beta) == (4.0, 25.0)
    assert c.attn_res_block_size == 12
    assert c.gate_lower_bound == -5.0 and c.kda_full_rank_output_gate
    assert not c.is_moe_layer(0) and c.is_moe_layer(1)


def test_tiny_presets_parse():
    kl = ModelConfig.from_dict(kl_tiny())
    k3 = ModelConfig.from_dict(k3_tiny())
    assert kl.arch == ARCH_KIMI_LINEAR and k3.arch == ARCH_KIMI_K3
    assert kl.layer_kinds == (KDA, MLA, KDA, MLA)
    assert k3.layer_kinds == (KDA, KDA, MLA, KDA, KDA, MLA)


def test_layer_lists_are_one_based():
    raw = kl_tiny()
    raw["linear_attn_config"].update(full_attn_layers=[1, 4], kda_layers=[2, 3])
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == (MLA, KDA, KDA, MLA)
    assert c.mla_layers == [0, 3] and c.kda_layers == [1, 2]


# Moonshot name -> HF transformers / DeepSeek alias, each with a non-default value so that reading the default
# instead of the alias shows.
ALIASES = [
    ("num_experts", "num_local_experts", 12),
    ("num_experts", "n_routed_experts", 12),
    ("num_experts_per_token", "num_experts_per_tok", 3),
    ("num_shared_experts", "n_shared_experts", 2),
    ("moe_renormalize", "norm_topk_prob", False),
    ("num_expert_group", "n_group", 2),
    ("model_max_length", "max_position_embeddings", 777),
    ("moe_router_activation_func", "scoring_func", "sigmoid"),
]


@pytest.mark.parametrize("moonshot,alias,value", ALIASES, ids=[a for _, a, _ in ALIASES])
def test_hf_alias_reads_like_moonshot_name(moonshot, alias, value):
    base = kl_tiny()   # 8 experts, top-2, 1 shared, renormalized, 1 group, 4096 positions
    moon = copy.deepcopy(base)
    moon[moonshot] = value
    hf = copy.deepcopy(base)
    hf.pop(moonshot, None)
    hf[alias] = value
    a, b = ModelConfig.from_dict(moon), ModelConfig.from_dict(hf)
    assert a == b
    default = ModelConfig.from_dict(base)
    if moonshot != "moe_router_activation_func":
        assert a != default, f"{moonshot}={value!r} did not change the parsed config"


def test_all_hf_aliases_together():
    moon = kl_tiny()
    moon.update(num_experts=6, num_experts_per_token=3, num_shared_experts=2, moe_renormalize=False,
                num_expert_group=2, topk_group=1, model_max_length=999)
    hf = copy.deepcopy(moon)
    for m, a, _ in ALIASES:
        if m in hf:
            hf[a] = hf.pop(m)
    assert ModelConfig.from_dict(hf) == ModelConfig.from_dict(moon)


def test_hf_native_layer_types_form():
    """HF transformers writes layer_types / mlp_layer_types / linear_* when built without linear_attn_config."""
    moon = kl_tiny()
    moon.update(first_k_dense_replace=2)
    moon["linear_attn_config"] = {"full_attn_layers": [1, 3], "kda_layers": [2, 4], "head_dim": 8, "num_heads": 2,
                                  "short_conv_kernel_size": 3}
    hf = copy.deepcopy(moon)
    del hf["linear_attn_config"], hf["first_k_dense_replace"]
    hf.update(layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "dense", "sparse", "sparse"], linear_head_dim=8, linear_num_heads=2,
              linear_conv_kernel_dim=3, linear_attn_config=None)
    a, b = ModelConfig.from_dict(moon), ModelConfig.from_dict(hf)
    assert a == b
    assert b.layer_kinds == (MLA, KDA, MLA, KDA) and b.first_k_dense_replace == 2
    assert (b.kda_head_dim, b.kda_num_heads, b.conv_kernel_size) == (8, 2, 3)


def test_transformers_config_dict_parses():
    from transformers import KimiLinearConfig
    hf = KimiLinearConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=3,
                          num_key_value_heads=3, num_local_experts=6, num_experts_per_tok=2, n_shared_experts=2,
                          n_group=3, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16,
                          linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2], "head_dim": 8,
                                              "num_heads": 3, "short_conv_kernel_size": 4})
    raw = hf.to_dict()
    raw["architectures"] = ["KimiLinearForCausalLM"]
    c = ModelConfig.from_dict(raw)
    assert c.layer_kinds == (KDA, KDA, MLA)
    assert (c.num_experts, c.num_experts_per_tok, c.n_shared_experts, c.n_group, c.topk_group) == (6, 2, 2, 3, 2)
    assert (c.kda_num_heads, c.kda_head_dim, c.vocab_size, c.hidden_size) == (3, 8, 300, 48)
    assert c.norm_topk_prob and c.first_k_dense_replace == 1


def _set(path: str, value):
    """An edit of the kimi-linear-tiny config: `a.b` sets raw[a][b]; a value of `DELETE` removes the key."""
    def edit(raw: dict) -> dict:
        d = raw
        *outer, last = path.split(".")
        for k in outer:
            d = d[k]
        if value is DELETE:
            d.pop(last)
        else:
            d[last] = value
        return raw
    return edit


DELETE = object()

BAD = [
    # (id, edit, words the message must contain)
    ("gelu", _set("hidden_act", "gelu"), ["hidden_act", "'gelu'"]),
    ("nope_false", _set("mla_use_nope", False), ["mla_use_nope", "False"]),
    ("softmax_router", _set("moe_router_activation_func", "softmax"), ["moe_router_activation_func", "'softmax'"]),
    ("softmax_scoring_alias", lambda r: _set("scoring_func", "softmax")(_set("moe_router_activation_func", DELETE)(r)),
     ["'softmax'"]),
    ("overlap", _set("linear_attn_config.kda_layers", [1, 2, 3]), ["layer 2", "full_attn_layers", "kda_layers"]),
    ("neither", _set("linear_attn_config.kda_layers", [1]), ["[3]", "neither"]),
    ("layer_zero", _set("linear_attn_config.full_attn_layers", [0, 2, 4]), ["full_attn_layers", "0"]),
    ("layer_past_end", _set("linear_attn_config.kda_layers", [1, 3, 5]), ["kda_layers", "5"]),
    ("layers_not_list", _set("linear_attn_config.kda_layers", "1,3"), ["kda_layers"]),
    ("gqa", _set("num_key_value_heads", 2), ["num_key_value_heads", "2"]),
    ("attention_bias", _set("attention_bias", True), ["attention_bias"]),
    ("top_k_too_big", _set("num_experts_per_token", 9), ["num_experts_per_token", "9"]),
    ("topk_method", _set("topk_method", "softmax_topk"), ["topk_method", "'softmax_topk'"]),
    ("groups_not_dividing", _set("num_expert_group", 3), ["num_expert_group=3"]),
    ("gate_lb_positive", _set("linear_attn_config.gate_lower_bound", 1.0), ["gate_lower_bound", "1.0"]),
    ("hidden_size_string", _set("hidden_size", "64"), ["hidden_size", "'64'"]),
    ("missing_vocab", _set("vocab_size", DELETE), ["vocab_size"]),
    ("renormalize_string", _set("moe_renormalize", "yes"), ["moe_renormalize", "'yes'"]),
    ("eps_string", _set("rms_norm_eps", "small"), ["rms_norm_eps", "'small'"]),
    ("architecture", lambda r: _set("architectures", ["LlamaForCausalLM"])(_set("model_type", "llama")(r)),
     ["LlamaForCausalLM", "'llama'"]),
    ("layer_types_bad", lambda r: {**_set("linear_attn_config", {})(r), "layer_types": ["mamba"] * 4},
     ["layer_types", "mamba"]),
    ("mlp_layer_types_bad", _set("mlp_layer_types", ["dense", "sparse", "dense", "sparse"]),
     ["mlp_layer_types", "'dense', 'sparse', 'dense', 'sparse'"]),
]


@pytest.mark.parametrize("edit,words", [(e, w) for _, e, w in BAD], ids=[i for i, _, _ in BAD])
def test_unsupported_value_is_one_line_config_error(edit, words):
    raw = edit(kl_tiny())
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(raw)
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_topk_group_too_small_for_top_k():
    raw = kl_tiny()
    raw.update(num_experts=8, num_experts_per_token=4, num_expert_group=4, topk_group=1)  # 2 experts kept < 4
    with pytest.raises(ConfigError, match="topk_group` = 1"):
        ModelConfig.from_dict(raw)
    raw["topk_group"] = 2
    assert ModelConfig.from_dict(raw).topk_group == 2


def test_k3_without_text_config():
    raw = k3_tiny()
    del raw["text_config"]
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict(raw)


def test_k3_errors_name_text_config():
    raw = k3_tiny()
    raw["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(raw)
    assert "text_config" in str(ei.value) and "hidden_act" in str(ei.value) and "'gelu'" in str(ei.value)


def test_from_dir_errors():
    d = scratch_dir("cfg")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"vocab_size": 12,')
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_dir(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(k3_tiny(), f)
    assert ModelConfig.from_dir(d) == ModelConfig.from_dict(k3_tiny())
