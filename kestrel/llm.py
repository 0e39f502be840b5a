"""The offline API: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import CheckpointError, ConfigError, RequestError
from kestrel.models.kimi import load_reference_model
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.engine import Engine, RequestOutput
from kestrel.runtime.memory import budget_line, cap_allocator, plan_cache, profile_memory
from kestrel.sampling_params import SamplingParams

log = logging.getLogger("kestrel")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device name; use auto, cpu, cuda or cuda:N")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return d


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not supported; use auto, float32 or bfloat16")
    return DTYPES[dtype]


def build_engine(ec: EngineConfig) -> Engine:
    """Config, tokenizer, weights, cache and engine for one checkpoint directory."""
    if not os.path.isdir(ec.model):
        raise CheckpointError(f"--model {ec.model}: no such directory")
    config = ModelConfig.from_dir(ec.model)
    device = resolve_device(ec.device)
    dtype = resolve_dtype(ec.dtype, device)
    tokenizer = _maybe_tokenizer(ec.model)
    log.info("loading %s (%s, %d layers) on %s as %s", ec.model, config.arch, config.num_layers, device,
             str(dtype).replace("torch.", ""))
    model = load_reference_model(ec.model, config, dtype, device)
    model = choose_modeling(model, modeling_context(config, device, dtype), ec.modeling)
    max_len = ec.max_model_len or config.max_position_embeddings
    profile = profile_memory(model, config, ec, dtype, device, max_len)      # GPU: the largest steps' peaks
    cap_allocator(ec, device)
    plan = plan_cache(config, ec, dtype, device, max_len, activation_peak=profile.activations if profile else 0,
                      graph_bytes=profile.graphs if profile else 0)
    log.info(plan.describe(config))
    cache = HybridCache(config, plan.num_pages, plan.page_size, plan.num_slots, plan.num_snapshots,
                        plan.max_pages_per_seq, dtype, device, ec.enable_prefix_caching)
    engine = Engine(config, ec, model, cache, tokenizer)      # captures the decode graphs (runtime/graphs.py)
    log.info(budget_line(profile, plan, engine.runner.graph_bytes, ec))
    return engine


def modeling_context(config: ModelConfig, device: torch.device, dtype: torch.dtype):
    """What stays fixed for the engine's life, as the router sees it."""
    from kestrel.catalog._op import current_arch
    from kestrel.models.kimi.routing import ModelingContext
    fmt = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
    return ModelingContext(config=config, arch=current_arch(device), quant=fmt, kv_cache_dtype=fmt)


def choose_modeling(model, ctx, modeling: str):
    """The reference model, or the fast-path target that claims this context (`--modeling`)."""
    import importlib
    from kestrel.models.kimi.routing import route
    chosen, traces = route(ctx, modeling)
    if chosen is None:
        if modeling == "auto":
            misses = [f"{t.target} ({t.first_miss().criterion})" for t in traces if t.first_miss()]
            log.info("modeling: reference implementation (no target claims this context: %s)",
                     ", ".join(misses) or "no targets")
        return model
    log.info("modeling: target %s", chosen)
    return importlib.import_module(f"kestrel.models.kimi.targets.{chosen}.modeling").build(model, ctx.config)


def _maybe_tokenizer(path: str):
    from kestrel.tokenizer import load_tokenizer
    try:
        return load_tokenizer(path)
    except CheckpointError as e:
        log.warning("%s; prompts must be token ids", e)
        return None


class LLM:
    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", **engine_args):
        self.engine = build_engine(EngineConfig(model=model, dtype=dtype, device=device, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("no prompts given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.engine.add_request(p, sp))
        except RequestError as e:
            for i in ids:
                self.engine.abort(i)
                self.engine.release(i)
            raise RequestError(f"prompt {len(ids)}: {e}") from None
        while self.engine.has_unfinished():
            self.engine.step()
        outs = [self.engine.final_output(i) for i in ids]
        for i in ids:
            self.engine.release(i)
        return outs

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise RequestError("this checkpoint has no chat template")
        return self.generate([self.chat_ids(messages)], params)[0]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The template's own special tokens become special ids; user text never does (it is encoded as text)."""
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), allow_special=True)
