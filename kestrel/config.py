"""Model and engine configuration.

`ModelConfig.from_dict` reads a checkpoint's config.json: Kimi Linear (`KimiLinearForCausalLM`, Moonshot's field
names or the aliases HF transformers writes) and Kimi K3 (`KimiK3ForConditionalGeneration`, the text model in
`text_config`). Everything downstream reads only `ModelConfig`, so the two spellings never leak further.
A value Kestrel cannot run is a `ConfigError` naming the field and the value.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass, field, asdict
from typing import Any

from kestrel.errors import ConfigError

ARCH_KIMI_LINEAR = "kimi_linear"
ARCH_KIMI_K3 = "kimi_k3"

MLA = "mla"
KDA = "kda"

QUANT_LAYOUTS = ("compressed-tensors", "modelopt")


@dataclass(frozen=True)
class QuantScheme:
    """How one group of linear layers is stored: `format` mxfp4 | nvfp4 | mxfp8 | fp8; `granularity` of the scale
    ("group" for the block formats; "tensor", "channel" or "block" (128x128) for fp8); `targets` the module-name
    patterns it covers (compressed-tensors: exact names, `re:` regexes, or "Linear" for every linear layer;
    ModelOpt: every linear layer)."""
    format: str
    granularity: str = "group"
    targets: tuple[str, ...] = ("Linear",)


@dataclass(frozen=True)
class QuantConfig:
    """A quantized checkpoint's scheme, from `quantization_config` (config.json) or `hf_quant_config.json`."""
    layout: str                        # "compressed-tensors" | "modelopt"
    schemes: tuple[QuantScheme, ...]
    ignore: tuple[str, ...] = ()       # compressed-tensors `ignore` / ModelOpt `exclude_modules`

    @property
    def weight_format(self) -> str:
        """What the router compares: the formats present, e.g. "mxfp4" or "fp8+nvfp4"."""
        return "+".join(sorted({s.format for s in self.schemes}))

    def scheme_for(self, module: str) -> QuantScheme | None:
        """The scheme of a linear layer named `module` as the checkpoint spells it, or None (not quantized)."""
        if any(_name_matches(module, p, self.layout) for p in self.ignore):
            return None
        for s in self.schemes:
            if any(t == "Linear" or _name_matches(module, t, self.layout) for t in s.targets):
                return s
        return None


def _name_matches(name: str, pattern: str, layout: str) -> bool:
    if layout == "modelopt":   # ModelOpt's exclude_modules are shell-style patterns over module names
        return fnmatch.fnmatchcase(name, pattern)
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # ARCH_KIMI_LINEAR or ARCH_KIMI_K3
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[str, ...]   # MLA or KDA per layer (0-based)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # MLA
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float | None     # K3 forget gate: lb * sigmoid(exp(A_log) * (f + dt_bias))
    kda_full_rank_output_gate: bool     # K3: g_proj [H*D, hidden]; Kimi Linear: g_b(g_a x)
    # MLP / MoE
    hidden_act: str                     # "silu" (SiLU-GLU) or "situ"
    situ_beta: float
    situ_linear_beta: float
    intermediate_size: int              # dense layers
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_expert_hidden_size: int | None  # latent MoE width (K3), None = experts run on the hidden state
    latent_moe_use_norm: bool
    # attention residuals (K3); 0 = plain residual stream
    attn_res_block_size: int
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quant: QuantConfig | None = None    # None: every weight is a plain float tensor
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Entries per token of one MLA layer's latent cache: the normalized latent plus the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_width(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == MLA]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == KDA]

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d

    # ---- parsing -------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{path}: no config.json; point --model at a checkpoint directory")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno}); fix or re-export it")
        hf_quant = os.path.join(path, "hf_quant_config.json")
        if os.path.isfile(hf_quant) and isinstance(raw, dict) and "quantization_config" not in raw:
            try:
                with open(hf_quant) as f:
                    raw = dict(raw, quantization_config=dict(json.load(f), quant_method="modelopt"))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{hf_quant}: not valid JSON ({e.msg} at line {e.lineno}); fix or re-export it")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(raw).__name__}; "
                              "re-export the checkpoint")
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if "KimiK3ForConditionalGeneration" in archs or model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json: K3 checkpoint without a `text_config` object")
            return _parse_text(text, ARCH_KIMI_K3, outer=raw)
        if "KimiLinearForCausalLM" in archs or model_type == "kimi_linear":
            return _parse_text(raw, ARCH_KIMI_LINEAR, outer=raw)
        raise ConfigError(
            f"config.json: architectures={archs} model_type={model_type!r} is not a Kimi Linear or Kimi K3 "
            "checkpoint; Kestrel serves KimiLinearForCausalLM and KimiK3ForConditionalGeneration")


class _Fields:
    """Reads fields by any of their spellings and remembers nothing else; errors name the field."""

    def __init__(self, d: dict, where: str):
        self.d, self.where = d, where

    def get(self, *names: str, default: Any = None, required: bool = False) -> Any:
        for n in names:
            if n in self.d and self.d[n] is not None:
                return self.d[n]
        if required:
            raise ConfigError(f"{self.where}: missing field `{names[0]}`")
        return default

    def int(self, *names: str, default: Any = None, required: bool = False, minimum: int = 0) -> Any:
        v = self.get(*names, default=default, required=required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{self.where}: `{names[0]}` = {v!r} must be an integer >= {minimum}")
        return v

    def float(self, *names: str, default: Any = None, required: bool = False) -> Any:
        v = self.get(*names, default=default, required=required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.where}: `{names[0]}` = {v!r} must be a number")
        return float(v)

    def bool(self, *names: str, default: Any = None) -> Any:
        v = self.get(*names, default=default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: `{names[0]}` = {v!r} must be true or false")
        return v


def _unsupported(where: str, name: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(f"{where}: `{name}` = {value!r} is not supported (Kestrel supports {supported})")


def _parse_text(d: dict, arch: str, outer: dict) -> ModelConfig:
    where = "config.json" + (" text_config" if arch == ARCH_KIMI_K3 else "")
    f = _Fields(d, where)
    lin = d.get("linear_attn_config") or {}
    if not isinstance(lin, dict):
        raise ConfigError(f"{where}: `linear_attn_config` must be an object")
    fl = _Fields(lin, where + " linear_attn_config")

    num_layers = f.int("num_hidden_layers", required=True, minimum=1)
    full = fl.get("full_attn_layers", default=[])
    kda = fl.get("kda_layers", default=[])
    kinds: list[str | None] = [None] * num_layers
    for name, layers, kind in (("full_attn_layers", full, MLA), ("kda_layers", kda, KDA)):
        if not isinstance(layers, list):
            raise ConfigError(f"{where}: linear_attn_config.{name} must be a list of 1-based layer numbers")
        for l in layers:
            if not isinstance(l, int) or not 1 <= l <= num_layers:
                raise ConfigError(f"{where}: linear_attn_config.{name} has {l!r}; layers are numbered 1..{num_layers}")
            if kinds[l - 1] is not None:
                raise ConfigError(f"{where}: layer {l} is listed in both full_attn_layers and kda_layers")
            kinds[l - 1] = kind
    layer_types = f.get("layer_types")
    if not full and not kda and isinstance(layer_types, list):
        # HF transformers' own spelling (a config built without linear_attn_config): one name per layer
        names = {"full_attention": MLA, "linear_attention": KDA}
        if len(layer_types) != num_layers or any(t not in names for t in layer_types):
            raise ConfigError(f"{where}: `layer_types` = {layer_types!r} must name each of the {num_layers} layers "
                              "'full_attention' or 'linear_attention'")
        kinds = [names[t] for t in layer_types]
    elif not full and not kda:
        raise ConfigError(f"{where}: linear_attn_config must list full_attn_layers and kda_layers")
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise ConfigError(f"{where}: layers {missing} are in neither full_attn_layers nor kda_layers")

    if f.get("mla_use_nope", default=True) is not True:
        raise _unsupported(where, "mla_use_nope", f.get("mla_use_nope"), "true: NoPE MLA, k_pe cached unrotated")
    n_kv = f.int("num_key_value_heads", default=None)
    n_heads = f.int("num_attention_heads", required=True, minimum=1)
    if n_kv is not None and n_kv != n_heads:
        raise _unsupported(where, "num_key_value_heads", n_kv, f"num_attention_heads ({n_heads}) for MLA")
    if f.get("attention_bias", default=False):
        raise _unsupported(where, "attention_bias", True, "false")

    act = f.get("hidden_act", default="silu")
    if act not in ("silu", "situ"):
        raise _unsupported(where, "hidden_act", act, "'silu' and 'situ'")
    router_act = f.get("moe_router_activation_func", "scoring_func", default="sigmoid")
    if router_act != "sigmoid":
        raise _unsupported(where, "moe_router_activation_func", router_act, "'sigmoid'")
    topk_method = f.get("topk_method", default="noaux_tc")
    if topk_method not in ("noaux_tc", "group_limited_greedy", "greedy"):
        raise _unsupported(where, "topk_method", topk_method, "'noaux_tc'")

    num_experts = f.int("num_experts", "n_routed_experts", "num_local_experts", default=0)
    top_k = f.int("num_experts_per_token", "num_experts_per_tok", default=0)
    if num_experts and not 1 <= top_k <= num_experts:
        raise ConfigError(f"{where}: `num_experts_per_token` = {top_k} must be in 1..{num_experts}")
    n_group = f.int("num_expert_group", "n_group", default=1, minimum=1)
    topk_group = f.int("topk_group", default=1, minimum=1)
    if num_experts and (num_experts % n_group or topk_group > n_group):
        raise ConfigError(f"{where}: num_expert_group={n_group}, topk_group={topk_group} do not divide "
                          f"{num_experts} experts")
    if n_group > 1 and num_experts // n_group < 2:
        raise ConfigError(f"{where}: grouped top-k scores each group by its best two experts; "
                          f"{num_experts // n_group} per group is too few")
    if num_experts and topk_group * (num_experts // n_group) < top_k:
        raise ConfigError(f"{where}: `topk_group` = {topk_group} keeps {topk_group * (num_experts // n_group)} "
                          f"experts, fewer than num_experts_per_token = {top_k}")
    gate_lb = fl.float("gate_lower_bound", default=None)
    if gate_lb is not None and gate_lb >= 0:
        raise ConfigError(f"{where}: linear_attn_config.gate_lower_bound = {gate_lb} must be negative")
    full_rank_gate = fl.get("use_full_rank_gate", default=None)
    if full_rank_gate is None:
        full_rank_gate = f.get("use_full_rank_gate", default=arch == ARCH_KIMI_K3)
    latent = f.int("routed_expert_hidden_size", default=None, minimum=1)
    hidden = f.int("hidden_size", required=True, minimum=1)
    if latent == hidden:
        latent = None

    eos = outer.get("eos_token_id", d.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    conv = fl.int("short_conv_kernel_size", default=f.int("linear_conv_kernel_dim", default=4, minimum=1), minimum=1)
    kda_heads = fl.int("num_heads", default=f.int("linear_num_heads", default=f.int("num_attention_heads"), minimum=1),
                       minimum=1)
    kda_head_dim = fl.int("head_dim", default=f.int("linear_head_dim", default=128, minimum=1), minimum=1)
    res_block = f.int("attn_res_block_size", default=0)
    mlp_types = f.get("mlp_layer_types")
    if mlp_types is not None and (not isinstance(mlp_types, list) or len(mlp_types) != num_layers
                                  or any(t not in ("dense", "sparse") for t in mlp_types)):
        raise ConfigError(f"{where}: `mlp_layer_types` = {mlp_types!r} must name each of the {num_layers} layers "
                          "'dense' or 'sparse'")
    leading_dense = num_layers if mlp_types is None else next(
        (i for i, t in enumerate(mlp_types) if t == "sparse"), num_layers)
    first_dense = f.int("first_k_dense_replace",
                        default=(1 if mlp_types is None else leading_dense) if num_experts else num_layers)
    freq = f.int("moe_layer_freq", default=1, minimum=1)
    if mlp_types is not None:
        implied = ["sparse" if num_experts and i >= first_dense and i % freq == 0 else "dense"
                   for i in range(num_layers)]
        if implied != mlp_types:
            raise _unsupported(where, "mlp_layer_types", mlp_types,
                               f"first_k_dense_replace={first_dense} dense layers then MoE every {freq} layer(s): "
                               f"{implied}")
    return ModelConfig(
        arch=arch,
        vocab_size=f.int("vocab_size", required=True, minimum=1),
        hidden_size=hidden,
        num_layers=num_layers,
        layer_kinds=tuple(kinds),  # type: ignore[arg-type]
        rms_norm_eps=f.float("rms_norm_eps", default=1e-5),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=outer.get("tie_word_embeddings", False))),
        max_position_embeddings=f.int("model_max_length", "max_position_embeddings", default=131072, minimum=1),
        num_heads=n_heads,
        q_lora_rank=f.int("q_lora_rank", default=None, minimum=1),
        kv_lora_rank=f.int("kv_lora_rank", required=True, minimum=1),
        qk_nope_head_dim=f.int("qk_nope_head_dim", required=True, minimum=1),
        qk_rope_head_dim=f.int("qk_rope_head_dim", default=64),
        v_head_dim=f.int("v_head_dim", required=True, minimum=1),
        mla_use_output_gate=f.bool("mla_use_output_gate", default=False),
        kda_num_heads=kda_heads,
        kda_head_dim=kda_head_dim,
        conv_kernel_size=conv,
        gate_lower_bound=gate_lb,
        kda_full_rank_output_gate=bool(full_rank_gate),
        hidden_act=act,
        situ_beta=f.float("activation_situ_beta", default=4.0),
        situ_linear_beta=f.float("activation_situ_linear_beta", default=25.0),
        intermediate_size=f.int("intermediate_size", default=0),
        first_k_dense_replace=first_dense,
        moe_layer_freq=freq,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        n_shared_experts=f.int("num_shared_experts", "n_shared_experts", default=0),
        moe_intermediate_size=f.int("moe_intermediate_size", default=0),
        routed_scaling_factor=f.float("routed_scaling_factor", default=1.0),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=f.bool("moe_renormalize", "norm_topk_prob", default=True),
        routed_expert_hidden_size=latent,
        latent_moe_use_norm=f.bool("latent_moe_use_norm", default=latent is not None),
        attn_res_block_size=res_block,
        bos_token_id=outer.get("bos_token_id", d.get("bos_token_id")),
        eos_token_ids=eos_ids,
        pad_token_id=outer.get("pad_token_id", d.get("pad_token_id")),
        quant=parse_quant(outer.get("quantization_config", d.get("quantization_config"))),
        extra={"raw": outer},
    )


# ---------------------------------------------------------------------------------------------------------------
# quantized checkpoints

_CT_FORMATS = {"mxfp4": "mxfp4-pack-quantized", "nvfp4": "nvfp4-pack-quantized", "mxfp8": "mxfp8-quantized",
               "fp8": "float-quantized"}


def parse_quant(qc: Any) -> QuantConfig | None:
    """The small structure the loader needs from a `quantization_config` (or `hf_quant_config.json`, given here
    with quant_method "modelopt"); a scheme Kestrel cannot read is a ConfigError naming it."""
    if qc is None:
        return None
    where = "config.json quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, where)
    if method == "modelopt":
        return _parse_modelopt(qc.get("quantization", qc), where)
    raise _unsupported(where, "quant_method", method, "'compressed-tensors' and 'modelopt'")


def _parse_compressed_tensors(qc: dict, where: str) -> QuantConfig:
    if qc.get("kv_cache_scheme"):
        raise _unsupported(where, "kv_cache_scheme", qc["kv_cache_scheme"], "null (quantized KV caches come later)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _unsupported(where, "quantization_status", status, "'compressed' (weights stored quantized)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}: `config_groups` must be a non-empty object")
    schemes = []
    for name, g in groups.items():
        gw = f"{where} config_groups.{name}"
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise ConfigError(f"{gw}: needs a `weights` object")
        if g.get("output_activations"):
            raise _unsupported(gw, "output_activations", g["output_activations"], "null")
        targets = g.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise ConfigError(f"{gw}: `targets` must be a non-empty list of module names or patterns")
        fmt, gran = _ct_weights(g["weights"], gw)
        declared = g.get("format") or qc.get("format")
        if declared not in (None, "mixed-precision", _CT_FORMATS[fmt]) and not (fmt == "fp8" and declared ==
                                                                                "naive-quantized"):
            raise ConfigError(f"{gw}: weights are {fmt} but `format` is {declared!r} (expected "
                              f"{_CT_FORMATS[fmt]!r}); re-export the checkpoint")
        schemes.append(QuantScheme(fmt, gran, tuple(targets)))
    return QuantConfig("compressed-tensors", tuple(schemes), _str_list(qc.get("ignore"), where, "ignore"))


def _ct_weights(w: dict, where: str) -> tuple[str, str]:
    """(format, granularity) of a compressed-tensors weights QuantizationArgs; refuses what Kestrel cannot read."""
    bits, typ, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    group, block = w.get("group_size"), w.get("block_structure")
    scheme = f"num_bits={bits} type={typ} strategy={strategy} group_size={group}"
    if typ != "float":
        raise _unsupported(where, "weights.type", typ, "'float' (MXFP4, NVFP4, MXFP8, FP8)")
    if w.get("symmetric", True) is not True or w.get("actorder") or w.get("dynamic", False):
        raise ConfigError(f"{where}: weights must be symmetric, static and without actorder ({scheme})")
    if bits == 4 and strategy == "group" and group == 32:
        return "mxfp4", "group"
    if bits == 4 and strategy == "tensor_group" and group == 16:
        return "nvfp4", "group"
    if bits == 8 and strategy == "group" and group == 32 and w.get("scale_dtype") in ("torch.uint8", "uint8"):
        return "mxfp8", "group"
    if bits == 8 and strategy in ("tensor", "channel"):
        return "fp8", strategy
    if bits == 8 and strategy == "block" and list(block or []) == [128, 128]:
        return "fp8", "block"
    raise ConfigError(f"{where}: weights {scheme} block_structure={block} is not supported (Kestrel reads MXFP4 "
                      "(group 32), NVFP4 (tensor_group 16), MXFP8 (group 32, uint8 scales) and FP8 per tensor, "
                      "channel or 128x128 block)")


def _parse_modelopt(q: dict, where: str) -> QuantConfig:
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: ModelOpt `quantization` must be an object")
    algo = q.get("quant_algo")
    if q.get("kv_cache_quant_algo"):
        raise _unsupported(where, "kv_cache_quant_algo", q["kv_cache_quant_algo"],
                           "null (quantized KV caches come later)")
    if algo == "NVFP4":
        if q.get("group_size", 16) != 16:
            raise _unsupported(where, "group_size", q["group_size"], "16 for NVFP4")
        scheme = QuantScheme("nvfp4")
    elif algo == "FP8":
        scheme = QuantScheme("fp8", "tensor")
    else:
        raise _unsupported(where, "quant_algo", algo, "'NVFP4' and 'FP8'")
    return QuantConfig("modelopt", (scheme,), _str_list(q.get("exclude_modules"), where, "exclude_modules"))


def _str_list(v: Any, where: str, name: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}: `{name}` must be a list of module names or patterns")
    return tuple(v)


SPEC_METHODS = ("ngram", "dspark")
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` (vLLM's JSON shape): which proposer guesses the next tokens and how many.

    - `method`: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the request's
      last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; no weights) or "dspark" (the drafter in
      `model`).
    - `num_speculative_tokens`: K, the draft tokens per step (the verify block is K + 1 tokens).
    - `enforce`: speculate on every decoding request every step, whatever the policy measures (kestrel/spec/
      policy.py); `disable_by_batch_size`: no speculation in a step with more decoding requests than this (vLLM's
      name); `ema`: the weight of the newest step in the policy's running averages.
    """
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    enforce: bool = False
    disable_by_batch_size: int | None = None
    ema: float = 0.1

    FIELDS = ("method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min", "enforce",
              "disable_by_batch_size", "ema")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """A JSON string, a dict or a SpeculativeConfig (None / "" / {}: no speculation); every field checked, a bad
        one a one-line ConfigError naming it."""
        if value is None or isinstance(value, cls):
            return value
        flag = "--speculative-config"
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"{flag}: not valid JSON ({e}); give an object such as "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag}: must be a JSON object with method and num_speculative_tokens")
        if not value:
            return None
        unknown = sorted(set(value) - set(cls.FIELDS))
        if unknown:
            raise ConfigError(f"{flag}: unknown field {unknown[0]!r}; the fields are {', '.join(cls.FIELDS)}")
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ConfigError(f"{flag}: method {method!r} is not supported; use one of {', '.join(SPEC_METHODS)}")

        def integer(name: str, default: Any, lo: int, hi: int | None = None) -> Any:
            v = value.get(name, default)
            if v is None and default is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                top = f"..{hi}" if hi is not None else " or more"
                raise ConfigError(f"{flag}: {name} {v!r} must be an integer {lo}{top}")
            return v

        if "num_speculative_tokens" not in value:
            raise ConfigError(f"{flag}: num_speculative_tokens is missing; give the draft tokens per step "
                              f"(1..{MAX_SPEC_TOKENS})")
        k = integer("num_speculative_tokens", None, 1, MAX_SPEC_TOKENS)
        hi = integer("prompt_lookup_max", 5, 1, 64)
        lo = integer("prompt_lookup_min", min(2, hi), 1, hi)
        enforce = value.get("enforce", False)
        if not isinstance(enforce, bool):
            raise ConfigError(f"{flag}: enforce {enforce!r} must be true or false")
        ema = value.get("ema", 0.1)
        if isinstance(ema, bool) or not isinstance(ema, (int, float)) or not 0 < ema <= 1:
            raise ConfigError(f"{flag}: ema {ema!r} must be a number in (0, 1]")
        model = value.get("model")
        if method == "dspark":
            if not isinstance(model, str) or not model:
                raise ConfigError(f"{flag}: method dspark needs \"model\": the drafter's checkpoint directory")
            if not os.path.isdir(model):
                raise ConfigError(f"{flag}: model {model}: no such directory (the DSpark drafter checkpoint; "
                                  "`kestrel train-drafter` writes one)")
        elif model is not None:
            raise ConfigError(f"{flag}: method ngram reads no drafter; remove \"model\"")
        return cls(method, k, model, hi, lo, enforce, integer("disable_by_batch_size", None, 1), float(ema))

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.FIELDS}


LOAD_FORMATS = ("auto", "random")
MODELING_MODES = ("off", "auto", "require")
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")     # auto: the model dtype (kestrel/quant/kv_cache.py: formats)
KDA_STATE_DTYPES = ("fp32", "bf16")
FP8_WEIGHT_READS = ("none", "moe-mlp")     # --fp8-weight-read (kestrel/models/kimi/fp8_read.py)


def parse_kv_cache_dtype_layers(text: str) -> dict[int, str]:
    """`--kv-cache-dtype-layers`: groups `LAYERS:DTYPE` separated by `;` (or spaces), LAYERS a comma list of 0-based
    layer indices (the model's own numbering) or ranges `a-b`: "91,92:fp8" (K3's last two MLA layers in FP8),
    "3-11:nvfp4;91,92:fp8". Raises ConfigError naming the bad piece."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"--kv-cache-dtype-layers {text!r}: {why}; write LAYERS:DTYPE groups such as "
                           "'91,92:fp8' or '3-11:nvfp4;91,92:fp8' (0-based layer indices)")

    out: dict[int, str] = {}
    groups = [g for g in re.split(r"[;\s]+", text.strip()) if g]
    if not groups:
        raise bad("no layer group")
    for g in groups:
        layers, sep, dtype = g.partition(":")
        if not sep or not layers:
            raise bad(f"{g!r} lacks ':DTYPE'")
        if dtype not in KV_CACHE_DTYPES:
            raise bad(f"unknown KV cache dtype {dtype!r} (use one of {', '.join(KV_CACHE_DTYPES)})")
        for piece in layers.split(","):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
            if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
                raise bad(f"{piece!r} is not a layer index or a rising range a-b")
            for i in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1):
                if out.get(i, dtype) != dtype:
                    raise bad(f"layer {i} is given two dtypes ({out[i]} and {dtype})")
                out[i] = dtype
    return out


@dataclass
class EngineConfig:
    """What the engine is asked to do with a model: device, dtype, memory, batching, modeling choice.

    Every value is checked when the config is made (`validate`) and against the model's own limits before any
    weight is read (`check_model`); a bad one is a `ConfigError` naming the CLI flag (the field's name with dashes).
    """
    model: str
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None
    page_size: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int | None = None    # pool size in tokens (CPU); None = derive from memory
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    memory_reserve_gib: float = 1.0
    enable_prefix_caching: bool = True
    modeling: str = "auto"            # off | auto | require
    seed: int = 0                     # request seeds, and the weights of load_format="random"
    load_format: str = "auto"         # auto: read the checkpoint's safetensors | random: seeded trained-like weights
    enforce_eager: bool = False       # no decode CUDA graphs (runtime/graphs.py): every step runs eagerly
    # launch decode step N+1 before the host has read step N's sampled ids (runtime/engine.py, "Async scheduling");
    # None: on where CUDA graphs are on (one rank, no speculation), off otherwise
    async_scheduling: bool | None = None
    kv_cache_dtype: str = "auto"      # MLA latent pages: auto (the model dtype) | bf16 | fp8 | nvfp4
    # per-layer override of kv_cache_dtype: "91,92:fp8" (0-based MLA layer indices), or the parsed {layer: dtype}
    kv_cache_dtype_layers: str | dict[int, str] | None = None
    kda_state_dtype: str = "fp32"     # KDA recurrent state slots: fp32 | bf16 (half the state bytes)
    # none | moe-mlp: the bf16 shared-expert and latent-MoE projections stored FP8 at load (lossy;
    # kestrel/models/kimi/fp8_read.py)
    fp8_weight_read: str = "none"
    # several ranks (kestrel/parallel/): vLLM's flags; world size = tensor_parallel_size * data_parallel_size
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    helix_size: int = 1               # MLA KV sharded along the sequence over this many ranks (vLLM: dcp size)
    moe_tp_size: int | None = None    # None: tp x dp without expert parallel, 1 with it
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None    # None: a free port (one host), else 29500 under torchrun's defaults
    # speculative decoding (kestrel/spec/): a JSON string or dict, parsed into a SpeculativeConfig; None: off
    speculative_config: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field on its own: types and ranges. Raises ConfigError naming the flag, the value and the fix."""
        def bad(flag: str, value: Any, why: str) -> ConfigError:
            return ConfigError(f"--{flag} {value!r}: {why}")

        def integer(flag: str, value: Any, minimum: int, optional: bool = False, maximum: int | None = None) -> None:
            if value is None and optional:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
                    or (maximum is not None and value > maximum):
                top = f" and <= {maximum}" if maximum is not None else ""
                raise bad(flag, value, f"must be an integer >= {minimum}{top}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", self.model, "must be a checkpoint directory")
        if self.dtype not in DTYPE_NAMES:
            raise bad("dtype", self.dtype, "is not supported; use auto, float32 or bfloat16")
        if not isinstance(self.device, str) or not self.device:
            raise bad("device", self.device, "is not a device name; use auto, cpu, cuda or cuda:N")
        integer("max-model-len", self.max_model_len, 1, optional=True)
        integer("page-size", self.page_size, 1)
        integer("max-num-seqs", self.max_num_seqs, 1)
        integer("max-num-batched-tokens", self.max_num_batched_tokens, 1)
        integer("kv-cache-tokens", self.kv_cache_tokens, 1, optional=True)
        integer("kv-cache-bytes", self.kv_cache_bytes, 1, optional=True)
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ConfigError("--kv-cache-tokens and --kv-cache-bytes both size the cache pool; give one of them")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise bad("gpu-memory-utilization", u, "must be in (0, 1] (the fraction of the GPU's memory the engine "
                                                   "may use)")
        r = self.memory_reserve_gib
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise bad("memory-reserve", r, "must be a finite number of GiB >= 0")
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce-eager", self.enforce_eager, "must be true or false")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad("async-scheduling", self.async_scheduling, "must be true or false (or left out: on where CUDA "
                                                                 "graphs are on)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise bad("enable-prefix-caching", self.enable_prefix_caching, "must be true or false")
        if self.modeling not in MODELING_MODES:
            raise bad("modeling", self.modeling, f"use one of {', '.join(MODELING_MODES)}")
        integer("seed", self.seed, 0, maximum=2 ** 64 - 1)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv-cache-dtype", self.kv_cache_dtype, f"use one of {', '.join(KV_CACHE_DTYPES)}")
        if isinstance(self.kv_cache_dtype_layers, str):
            self.kv_cache_dtype_layers = parse_kv_cache_dtype_layers(self.kv_cache_dtype_layers)
        elif self.kv_cache_dtype_layers is not None:
            layers = self.kv_cache_dtype_layers
            if not isinstance(layers, dict) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                   or d not in KV_CACHE_DTYPES for i, d in layers.items()):
                raise bad("kv-cache-dtype-layers", layers, "must map 0-based layer indices to one of "
                                                           f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kda_state_dtype not in KDA_STATE_DTYPES:
            raise bad("kda-state-dtype", self.kda_state_dtype, f"use one of {', '.join(KDA_STATE_DTYPES)}")
        if self.fp8_weight_read not in FP8_WEIGHT_READS:
            raise bad("fp8-weight-read", self.fp8_weight_read, f"use one of {', '.join(FP8_WEIGHT_READS)} (moe-mlp: "
                                                               "the shared-expert and latent-MoE projections as FP8)")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.load_format not in LOAD_FORMATS:
            raise bad("load-format", self.load_format, f"use one of {', '.join(LOAD_FORMATS)} (random: seeded "
                                                       "random weights, no safetensors read)")
        integer("tensor-parallel-size", self.tensor_parallel_size, 1)
        integer("data-parallel-size", self.data_parallel_size, 1)
        integer("helix-size", self.helix_size, 1)
        integer("moe-tp-size", self.moe_tp_size, 1, optional=True)
        integer("nnodes", self.nnodes, 1)
        integer("node-rank", self.node_rank, 0, maximum=self.nnodes - 1)
        integer("master-port", self.master_port, 1, optional=True, maximum=65535)
        if not isinstance(self.enable_expert_parallel, bool):
            raise bad("enable-expert-parallel", self.enable_expert_parallel, "must be true or false")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise bad("master-addr", self.master_addr, "must be a host name or address")
        if self.speculative_config is not None and self.world_size > 1:
            raise ConfigError("--speculative-config runs on one rank for now: drop --tensor-parallel-size, "
                              "--data-parallel-size and --helix-size, or speculation")
        if self.async_scheduling and self.speculative_config is not None:
            raise ConfigError("--async-scheduling does not overlap speculative verify steps: drop "
                              "--speculative-config or pass --no-async-scheduling")
        if self.async_scheduling and self.world_size > 1:
            raise ConfigError("--async-scheduling runs on one rank (the ranks' lockstep broadcast needs each step's "
                              "token ids on the host): pass --no-async-scheduling or drop the parallel layout")

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: --helix-size alone implies as many tensor-parallel ranks (kestrel/parallel)."""
        return max(self.tensor_parallel_size, self.helix_size) * self.data_parallel_size

    def check_model(self, config: ModelConfig) -> int:
        """The checks that need the model's config.json; returns the context length the engine will serve."""
        limit = config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ConfigError(f"--max-model-len {self.max_model_len} is past this model's limit of {limit} tokens "
                              f"(max_position_embeddings in config.json); use at most {limit}")
        self.mla_cache_dtypes(config)
        return self.max_model_len or limit

    def mla_cache_dtypes(self, config: ModelConfig) -> dict[int, str]:
        """The KV cache dtype of every MLA layer (`kv_cache_dtype`, then the per-layer overrides); an override
        naming a layer that is not an MLA layer is a ConfigError."""
        out = {i: self.kv_cache_dtype for i in config.mla_layers}
        for i, d in sorted((self.kv_cache_dtype_layers or {}).items()):
            if i not in out:
                what = f"layer {i} is a KDA layer" if i < config.num_layers else \
                    f"layer {i} is past the model's {config.num_layers} layers"
                raise ConfigError(f"--kv-cache-dtype-layers: {what}; name MLA layers (0-based): "
                                  f"{', '.join(map(str, config.mla_layers))}")
            out[i] = d
        return out
