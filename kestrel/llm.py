"""The offline API: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from kestrel.config import EngineConfig, ModelConfig
from kestrel.errors import CheckpointError, ConfigError, RequestError
from kestrel.models.kimi import load_reference_model
from kestrel.models.kimi.checkpoint import random_reference_model
from kestrel.models.kimi.weights import shard_files, weights_nbytes
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


@dataclass(frozen=True)
class EngineSetup:
    """What `build_engine` settles before it reads a single weight: every flag, the config, the device, the
    tokenizer and the routing decision. A bad flag, config.json or tokenizer fails here, in seconds."""
    ec: EngineConfig
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: object | None
    max_model_len: int
    target: str | None          # the fast path that claims this context; None = the reference implementation


def setup_engine(ec: EngineConfig, needs_tokenizer: bool = False) -> EngineSetup:
    """Validate an engine config against its checkpoint without loading weights (`kestrel serve` and every other
    command get these checks through `build_engine`; call this first to fail before other slow work).
    `needs_tokenizer`: a checkpoint without tokenizer files is an error (text prompts), not a warning."""
    ec.validate()
    if not os.path.isdir(ec.model):
        raise CheckpointError(f"--model {ec.model}: no such directory")
    config = ModelConfig.from_dir(ec.model)
    max_len = ec.check_model(config)
    device = resolve_device(ec.device)
    dtype = resolve_dtype(ec.dtype, device)
    tokenizer = checkpoint_tokenizer(ec.model, required=needs_tokenizer)
    if ec.load_format == "auto":
        shard_files(ec.model)     # a folder without weights fails now, naming --load-format random
    check_memory(config, ec, dtype, device, max_len)
    log.info("loading %s (%s, %d layers) on %s as %s", ec.model, config.arch, config.num_layers, device,
             str(dtype).replace("torch.", ""))
    spec = ec.speculative_config.method if ec.speculative_config else "none"
    target = route_modeling(modeling_context(config, device, dtype, spec), ec.modeling)
    return EngineSetup(ec, config, device, dtype, tokenizer, max_len, target)


def build_engine(ec: EngineConfig | EngineSetup) -> Engine:
    """Config, tokenizer, weights, cache and engine for one checkpoint directory. Everything a user can get wrong
    is checked (`setup_engine`) before the first weight is read."""
    s = ec if isinstance(ec, EngineSetup) else setup_engine(ec)
    ec, config, device, dtype = s.ec, s.config, s.device, s.dtype
    t0 = time.perf_counter()
    if ec.load_format == "random":
        log.info("random weights: seed %d, drawn on %s (no checkpoint tensors read)", ec.seed, device)
        model = random_reference_model(config, dtype, device, ec.seed)
    else:
        model = load_reference_model(ec.model, config, dtype, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info("weights: %.2f GiB in %.1f s", nbytes / 2 ** 30, time.perf_counter() - t0)
    log.info("building the model: %s", f"target {s.target}" if s.target else "reference implementation")
    model = build_modeling(model, config, s.target)
    proposer, extra = None, {}
    if ec.speculative_config is not None:      # the drafter's layers share the cache budget: plan with them
        from kestrel.spec import make_proposer
        proposer = make_proposer(ec.speculative_config, config, device, dtype)
        extra = {i: "mla" for i in proposer.extra_layers}
        log.info("speculative decoding: %s, %d draft tokens per step%s", ec.speculative_config.method,
                 proposer.num_tokens, f", drafter layers {sorted(extra)} in the cache pools" if extra else "")
    profile = profile_memory(model, config, ec, dtype, device, s.max_model_len)   # GPU: the largest steps' peaks
    cap_allocator(ec, device)
    plan = plan_cache(config, ec, dtype, device, s.max_model_len,
                      activation_peak=profile.activations if profile else 0,
                      graph_bytes=profile.graphs if profile else 0, extra_layers=extra or None)
    log.info("planning the cache: %s", plan.describe(config))
    try:
        cache = HybridCache(config, plan.num_pages, plan.page_size, plan.num_slots, plan.num_snapshots,
                            plan.max_pages_per_seq, dtype, device, ec.enable_prefix_caching)
    except RuntimeError as e:     # torch.OutOfMemoryError on CUDA, "can't allocate memory" on the CPU
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        raise ConfigError(f"cannot allocate the KV cache on {device} ({_gib(plan.nbytes)}: "
                          f"{str(e).splitlines()[0][:120]}); lower --max-num-seqs, --kv-cache-tokens or "
                          "--kv-cache-bytes") from None
    if extra:
        cache.add_layers(extra, getattr(proposer, "cache_config", None))
    engine = Engine(config, ec, model, cache, s.tokenizer, proposer)   # captures the decode graphs (graphs.py)
    log.info(budget_line(profile, plan, engine.runner.graph_bytes, ec))
    return engine


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def check_memory(config: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
                 max_len: int) -> None:
    """Weights (and on the CPU the cache pools, sized by arithmetic alone) that cannot fit the device are an error
    now, not an allocator failure after minutes of loading."""
    weights = weights_nbytes(config, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if weights > free:
            raise ConfigError(f"the weights need {_gib(weights)} in {str(dtype).replace('torch.', '')} but {device} "
                              f"has {_gib(free)} free; use a GPU with more memory or free this one")
        return
    if device.type != "cpu":
        return
    pools = plan_cache(config, ec, dtype, device, max_len).nbytes
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if weights + pools > ram:
        raise ConfigError(f"weights ({_gib(weights)}) and KV cache ({_gib(pools)}) need more than this machine's "
                          f"{_gib(ram)} of memory; lower --max-num-seqs, --kv-cache-tokens or --kv-cache-bytes, or "
                          "use a smaller --dtype")


def modeling_context(config: ModelConfig, device: torch.device, dtype: torch.dtype, spec: str = "none"):
    """What stays fixed for the engine's life, as the router sees it (`spec`: the speculative method or none)."""
    from kestrel.catalog._op import current_arch
    from kestrel.models.kimi.routing import ModelingContext
    fmt = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
    return ModelingContext(config=config, arch=current_arch(device), quant=fmt, kv_cache_dtype=fmt, spec=spec)


def route_modeling(ctx, modeling: str) -> str | None:
    """The fast-path target that claims this context (`--modeling`), or None for the reference implementation;
    `require` without a claiming target raises here, before any weight is read."""
    from kestrel.models.kimi.routing import route
    chosen, traces = route(ctx, modeling)
    if chosen is None:
        if modeling == "auto":
            misses = [f"{t.target} ({t.first_miss().criterion})" for t in traces if t.first_miss()]
            log.info("modeling: reference implementation (no target claims this context: %s)",
                     ", ".join(misses) or "no targets")
        return None
    log.info("modeling: target %s", chosen)
    return chosen


def build_modeling(model, config: ModelConfig, target: str | None):
    """The reference model itself, or target `target` built over its weights."""
    if target is None:
        return model
    import importlib
    return importlib.import_module(f"kestrel.models.kimi.targets.{target}.modeling").build(model, config)


def checkpoint_tokenizer(path: str, required: bool = False):
    """The checkpoint's tokenizer, or None when it ships no tokenizer files at all (prompts must then be token
    ids; an error when `required`). Tokenizer files that are there but broken or incomplete are an error naming
    the file."""
    from kestrel.tokenizer import CONFIG_FILE, HF_TOKENIZER_FILE, TIKTOKEN_FILE, load_tokenizer

    def has(fn: str) -> bool:
        return os.path.isfile(os.path.join(path, fn))

    if not any(has(fn) for fn in (TIKTOKEN_FILE, HF_TOKENIZER_FILE, CONFIG_FILE)):
        if required:
            raise CheckpointError(f"{path} has no tokenizer ({TIKTOKEN_FILE} or {HF_TOKENIZER_FILE}), so text "
                                  "prompts cannot be encoded; copy the checkpoint's tokenizer files there")
        log.warning("%s has no tokenizer (%s or %s): prompts must be token ids", path, TIKTOKEN_FILE,
                    HF_TOKENIZER_FILE)
        return None
    if not has(TIKTOKEN_FILE) and not has(HF_TOKENIZER_FILE):
        missing = _tokenizer_file_named_by(os.path.join(path, CONFIG_FILE), TIKTOKEN_FILE, HF_TOKENIZER_FILE)
        raise CheckpointError(f"{path} has {CONFIG_FILE} but no {missing}; copy {missing} from the original "
                              f"checkpoint, or remove {CONFIG_FILE} to serve token ids only")
    return load_tokenizer(path)


def _tokenizer_file_named_by(config_path: str, tiktoken_file: str, hf_file: str) -> str:
    """The tokenizer file a tokenizer_config.json expects: Kimi's tiktoken form, or a `tokenizer.json`."""
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict) or not cfg.get("tokenizer_class"):
        return f"{tiktoken_file} or {hf_file}"
    named = f"{cfg.get('tokenizer_class')} {cfg.get('auto_map', '')}".lower()
    return tiktoken_file if "tiktoken" in named or "kimi" in named else hf_file


class LLM:
    """`LLM(model=DIR, dtype=..., device=..., load_format="auto" | "random", **EngineConfig fields)`: a bad argument
    is a ConfigError naming the matching CLI flag, raised before any weight is read."""

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
        return self.tokenizer.encode_chat(messages)
