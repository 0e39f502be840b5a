"""A DSpark drafter's config.json: which target layers it reads, its MLA draft layers, the mask token, K.

Field names follow the public DSpark drafters (vLLM's K3 `dspark_mla.py`, DeepSpec's `dspark/`): `target_layer_ids`
(also spelled `dspark_target_layer_ids`: 0-based target layers whose output the context projection reads),
`num_hidden_layers` (draft layers), `mask_token_id` (the id the block's K-1 unknown places carry), `block_size`
(the K the drafter was trained for), `markov_rank`, `enable_confidence_head` / `confidence_head_with_markov`, and
the MLA widths of a K3 attention layer. The drafter shares the target's embedding and LM head, so its hidden size
and vocabulary must be the target's; `check_target` says so in one line when they are not.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from kestrel.config import MLA, ModelConfig
from kestrel.errors import ConfigError

ARCHITECTURE = "K3DSparkForCausalLM"


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    vocab_size: int
    num_layers: int                     # draft layers
    target_layer_ids: tuple[int, ...]   # 0-based target layers whose outputs are concatenated into the context
    target_hidden_size: int
    mask_token_id: int
    block_size: int                     # K: draft tokens per block (the block is [last, mask x (K-1)])
    markov_rank: int
    intermediate_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True

    @property
    def mla_cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def layer_config(self, target: ModelConfig) -> ModelConfig:
        """The ModelConfig the reference MLA / MLP modules read for a draft layer: the target's, with the drafter's
        widths (one dense MLA layer)."""
        return dataclasses.replace(
            target, hidden_size=self.hidden_size, num_layers=1, layer_kinds=(MLA,), num_heads=self.num_heads,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            mla_use_output_gate=self.mla_use_output_gate, hidden_act=self.hidden_act,
            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps, num_experts=0,
            attn_res_block_size=0, quant=None)

    def check_target(self, target: ModelConfig, where: str = "drafter config.json") -> None:
        if self.hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
            raise ConfigError(f"{where}: hidden_size {self.hidden_size} / vocab_size {self.vocab_size} must equal the "
                              f"target's {target.hidden_size} / {target.vocab_size} (the drafter shares its "
                              "embedding and LM head); use a drafter trained for this target")
        if self.target_hidden_size != target.hidden_size:
            raise ConfigError(f"{where}: target_hidden_size {self.target_hidden_size} is not the target's "
                              f"hidden_size {target.hidden_size}; use a drafter trained for this target")
        bad = [l for l in self.target_layer_ids if not 0 <= l < target.num_layers]
        if bad:
            raise ConfigError(f"{where}: target_layer_ids {bad} are not layers of the target (0..{target.num_layers - 1})"
                              "; use a drafter trained for this target")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["num_hidden_layers"] = d.pop("num_layers")
        d["num_attention_heads"] = d.pop("num_heads")
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["num_target_layers"] = len(self.target_layer_ids)
        d["draft_vocab_size"] = self.vocab_size
        return {"architectures": [ARCHITECTURE], "model_type": "dspark", **d}

    def save(self, folder: str) -> None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_dir(cls, folder: str) -> "DSparkConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{folder}: no config.json; point the speculative config's model at a DSpark drafter "
                              "folder (or make one with `kestrel train-drafter`)")
        try:
            with open(path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix or re-export it")
        return cls.from_dict(raw, where=path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "drafter config.json") -> "DSparkConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        sub = raw.get("dspark_config") if isinstance(raw.get("dspark_config"), dict) else {}

        def get(*names, default=None, required=False):
            for d in (raw, sub):
                for n in names:
                    if d.get(n) is not None:
                        return d[n]
            if required:
                raise ConfigError(f"{where}: missing field `{names[0]}`; a DSpark drafter's config names it")
            return default

        def integer(*names, default=None, required=False, minimum=0):
            v = get(*names, default=default, required=required)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"{where}: `{names[0]}` = {v!r} must be an integer >= {minimum}")
            return v

        layers = get("target_layer_ids", "dspark_target_layer_ids", "layer_ids", required=True)
        if not isinstance(layers, list) or not layers or any(isinstance(l, bool) or not isinstance(l, int)
                                                             or l < 0 for l in layers) \
                or sorted(set(layers)) != layers:
            raise ConfigError(f"{where}: `target_layer_ids` = {layers!r} must be a non-empty increasing list of "
                              "0-based target layer numbers")
        vocab = integer("vocab_size", required=True, minimum=1)
        draft_vocab = integer("draft_vocab_size", default=vocab, minimum=1)
        if draft_vocab != vocab:
            raise ConfigError(f"{where}: `draft_vocab_size` = {draft_vocab} (a reduced draft vocabulary) is not "
                              f"supported; Kestrel runs full-vocabulary drafters (draft_vocab_size = {vocab})")
        rope = get("rope_scaling")
        if rope not in (None, {}) and not (isinstance(rope, dict) and rope.get("rope_type", rope.get("type"))
                                           in ("default", None)):
            raise ConfigError(f"{where}: `rope_scaling` = {rope!r} is not supported (Kestrel's drafter runs plain "
                              "RoPE with rope_theta)")
        act = get("hidden_act", default="silu")
        if act not in ("silu", "situ"):
            raise ConfigError(f"{where}: `hidden_act` = {act!r} is not supported (Kestrel supports 'silu', 'situ')")
        hidden = integer("hidden_size", required=True, minimum=1)
        cfg = cls(
            hidden_size=hidden, vocab_size=vocab, num_layers=integer("num_hidden_layers", required=True, minimum=1),
            target_layer_ids=tuple(layers), target_hidden_size=integer("target_hidden_size", default=hidden, minimum=1),
            mask_token_id=integer("mask_token_id", "dspark_noise_token_id", "parallel_drafting_token_id",
                                  required=True),
            block_size=integer("block_size", "num_speculative_tokens", required=True, minimum=1),
            markov_rank=integer("markov_rank", "dspark_markov_rank", default=0),
            intermediate_size=integer("intermediate_size", required=True, minimum=1),
            num_heads=integer("num_attention_heads", required=True, minimum=1),
            q_lora_rank=integer("q_lora_rank", default=None, minimum=1),
            kv_lora_rank=integer("kv_lora_rank", required=True, minimum=1),
            qk_nope_head_dim=integer("qk_nope_head_dim", required=True, minimum=1),
            qk_rope_head_dim=integer("qk_rope_head_dim", required=True, minimum=2),
            v_head_dim=integer("v_head_dim", required=True, minimum=1),
            mla_use_output_gate=bool(get("mla_use_output_gate", default=False)), hidden_act=act,
            rms_norm_eps=float(get("rms_norm_eps", default=1e-5)), rope_theta=float(get("rope_theta", default=1e4)),
            enable_confidence_head=bool(get("enable_confidence_head", default=False)),
            confidence_head_with_markov=bool(get("confidence_head_with_markov", default=False)))
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"{where}: `qk_rope_head_dim` = {cfg.qk_rope_head_dim} must be even (RoPE pairs)")
        if cfg.mask_token_id >= vocab:
            raise ConfigError(f"{where}: `mask_token_id` = {cfg.mask_token_id} is outside the vocabulary ({vocab})")
        if cfg.confidence_head_with_markov and cfg.enable_confidence_head and not cfg.markov_rank:
            raise ConfigError(f"{where}: `confidence_head_with_markov` needs a Markov head (`markov_rank` > 0)")
        return cfg


def tiny_config(target: ModelConfig, block_size: int = 4, num_layers: int = 1,
                target_layer_ids: tuple[int, ...] | None = None) -> DSparkConfig:
    """A drafter for a tiny target (tests, `kestrel train-drafter`): the target's MLA widths, one dense draft layer
    over the outputs of three target layers (early, middle, last but one, as the public recipes spread them)."""
    n = target.num_layers
    if target_layer_ids is None:
        target_layer_ids = tuple(sorted({min(1, n - 1), n // 2, max(n - 2, 0)}))
    return DSparkConfig(
        hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=num_layers,
        target_layer_ids=tuple(target_layer_ids), target_hidden_size=target.hidden_size,
        mask_token_id=target.vocab_size - 1, block_size=block_size, markov_rank=min(64, target.vocab_size),
        intermediate_size=2 * target.hidden_size, num_heads=target.num_heads, q_lora_rank=target.q_lora_rank,
        kv_lora_rank=target.kv_lora_rank, qk_nope_head_dim=target.qk_nope_head_dim,
        qk_rope_head_dim=target.qk_rope_head_dim, v_head_dim=target.v_head_dim,
        mla_use_output_gate=False, hidden_act="silu", rms_norm_eps=target.rms_norm_eps,
        enable_confidence_head=True, confidence_head_with_markov=True)
