"""Model and engine configuration.

`ModelConfig.from_dict` reads a checkpoint's config.json: Kimi Linear (`KimiLinearForCausalLM`, Moonshot's field
names or the aliases HF transformers writes) and Kimi K3 (`KimiK3ForConditionalGeneration`, the text model in
`text_config`). Everything downstream reads only `ModelConfig`, so the two spellings never leak further.
A value Kestrel cannot run is a `ConfigError` naming the field and the value.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, asdict
from typing import Any

from kestrel.errors import ConfigError

ARCH_KIMI_LINEAR = "kimi_linear"
ARCH_KIMI_K3 = "kimi_k3"

MLA = "mla"
KDA = "kda"


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
        extra={"raw": outer},
    )


@dataclass
class EngineConfig:
    """What the engine is asked to do with a model: device, dtype, memory, batching, modeling choice."""
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
    seed: int = 0
    enforce_eager: bool = False       # no decode CUDA graphs (runtime/graphs.py): every step runs eagerly
