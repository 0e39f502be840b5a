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
from kestrel.models.kimi.fp8_read import apply_fp8_weight_read
from kestrel.models.kimi.weights import shard_files, weights_nbytes
from kestrel.parallel.mapping import Mapping
from kestrel.runtime import precompile
from kestrel.runtime.cache import HybridCache
from kestrel.runtime.engine import Engine, RequestOutput
from kestrel.runtime.memory import (budget_line, cache_formats, cap_allocator, limit_block_splitting, plan_cache,
                                    profile_memory)
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
    mapping: Mapping = Mapping()   # the layout (rank 0's view; each rank gets its own in build_engine)


def setup_engine(ec: EngineConfig, needs_tokenizer: bool = False) -> EngineSetup:
    """Validate an engine config against its checkpoint without loading weights (`kestrel serve` and every other
    command get these checks through `build_engine`; call this first to fail before other slow work).
    `needs_tokenizer`: a checkpoint without tokenizer files is an error (text prompts), not a warning."""
    ec.validate()
    if not os.path.isdir(ec.model):
        raise CheckpointError(f"--model {ec.model}: no such directory")
    config = ModelConfig.from_dir(ec.model)
    max_len = ec.check_model(config)
    mapping = Mapping.from_engine_config(ec)
    mapping.validate(config, ec.page_size)       # heads / experts that do not split: before any weight is read
    device = resolve_device(ec.device)
    dtype = resolve_dtype(ec.dtype, device)
    tokenizer = checkpoint_tokenizer(ec.model, required=needs_tokenizer)
    if ec.load_format == "auto":
        shard_files(ec.model)     # a folder without weights fails now, naming --load-format random
    cache_formats(config, ec, dtype)       # a latent width the KV cache dtype cannot store fails now
    check_memory(config, ec, dtype, device, max_len, mapping)
    log.info("loading %s (%s, %d layers) on %s as %s%s", ec.model, config.arch, config.num_layers, device,
             str(dtype).replace("torch.", ""), f", layout {mapping.name}" if mapping.parallel else "")
    target = route_modeling(modeling_context(config, device, dtype, ec, mapping.name), ec.modeling)
    return EngineSetup(ec, config, device, dtype, tokenizer, max_len, target, mapping)


def build_engine(ec: EngineConfig | EngineSetup) -> Engine:
    """Config, tokenizer, weights, cache and engine for one checkpoint directory. Everything a user can get wrong
    is checked (`setup_engine`) before the first weight is read."""
    s = ec if isinstance(ec, EngineSetup) else setup_engine(ec)
    if s.mapping.parallel:
        return build_rank_engine(s)
    # start-up's Triton compiles run in worker processes started now, ahead of each warm-up (runtime/precompile.py)
    with precompile.ahead(s.device):
        return _build_single(s)


def _build_single(s: EngineSetup) -> Engine:
    ec, config, device, dtype = s.ec, s.config, s.device, s.dtype
    t0 = time.perf_counter()
    limit_block_splitting(device)
    if ec.load_format == "random":
        log.info("random weights: seed %d, drawn on %s (no checkpoint tensors read)", ec.seed, device)
        model = random_reference_model(config, dtype, device, ec.seed)
    else:
        model = load_reference_model(ec.model, config, dtype, device)
    apply_fp8_weight_read(model, config, ec.fp8_weight_read)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())   # quantized buffers too
    log.info("weights: %.2f GiB in %.1f s", nbytes / 2 ** 30, time.perf_counter() - t0)
    log.info("building the model: %s", f"target {s.target}" if s.target else "reference implementation")
    model = build_modeling(model, config, s.target)
    proposer, extra_mla = None, None
    if ec.speculative_config is not None:      # the drafter's layers share the cache budget: plan with them
        from kestrel.spec import make_proposer
        proposer = make_proposer(ec.speculative_config, config, device, dtype)
        extra_mla = getattr(proposer, "extra_mla", None) or None       # drafter MLA layer id -> latent width
        if hasattr(proposer, "share_target"):       # a drafter reads the target's embedding and LM head
            proposer.share_target(model)
        log.info("speculative decoding: %s, %d draft tokens per step%s", ec.speculative_config.method,
                 proposer.num_tokens, f", drafter layers {sorted(extra_mla)} in the cache pools" if extra_mla else "")
    profile = profile_memory(model, config, ec, dtype, device, s.max_model_len)   # GPU: the largest steps' peaks
    cap_allocator(ec, device)
    plan = plan_cache(config, ec, dtype, device, s.max_model_len,
                      activation_peak=profile.activations if profile else 0,
                      graph_bytes=profile.graphs if profile else 0, extra_mla=extra_mla)
    log.info("planning the cache: %s", plan.describe(config))
    kv_formats, state_dtype = cache_formats(config, ec, dtype)
    try:
        cache = HybridCache(config, plan.num_pages, plan.page_size, plan.num_slots, plan.num_snapshots,
                            plan.max_pages_per_seq, dtype, device, ec.enable_prefix_caching, kv_formats=kv_formats,
                            state_dtype=state_dtype, extra_kv_kind=ec.kv_cache_dtype, extra_mla=extra_mla)
    except RuntimeError as e:     # torch.OutOfMemoryError on CUDA, "can't allocate memory" on the CPU
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        raise ConfigError(f"cannot allocate the KV cache on {device} ({_gib(plan.nbytes)}: "
                          f"{str(e).splitlines()[0][:120]}); lower --max-num-seqs, --kv-cache-tokens or "
                          "--kv-cache-bytes") from None
    engine = Engine(config, ec, model, cache, s.tokenizer, proposer)   # captures the decode graphs (graphs.py)
    engine.cache_plan = plan        # what the budget bought (benchmarks report how many long requests it holds)
    log.info(budget_line(profile, plan, engine.runner.graph_bytes, ec))
    return engine


def build_rank_engine(s: EngineSetup):
    """This process's rank of a layout over several ranks: rank 0 gets its engine (`run_rank`); a follower runs
    rank 0's steps until rank 0 stops, and its process then exits (this function does not return there)."""
    engine = run_rank(s)
    if engine is None:
        raise SystemExit(0)
    return engine


def run_rank(s: EngineSetup):
    """This process's rank of a layout over several ranks (kestrel/parallel/): join the group (once per process),
    load the rank's part of the weights and its cache pools, then either return the engine that drives the group
    (rank 0: an `Engine`, or a `DPEngine` over data-parallel ranks; its `stop()` releases the others) or follow
    rank 0's steps until it stops and return None. Decode CUDA graphs are off: the steps run eagerly with their
    collectives."""
    import atexit
    from dataclasses import replace
    from kestrel.parallel.launch import init_group
    from kestrel.runtime import lockstep
    ec, config, dtype = s.ec, s.config, s.dtype
    m = init_group(ec, s.device.type)
    device = torch.device("cuda", m.local_rank) if s.device.type == "cuda" else s.device
    t0 = time.perf_counter()
    limit_block_splitting(device)
    if ec.load_format == "random":
        model = random_reference_model(config, dtype, device, ec.seed, m)
    else:
        model = load_reference_model(ec.model, config, dtype, device, m)
    apply_fp8_weight_read(model, config, ec.fp8_weight_read)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())   # quantized buffers too
    # the pools hold this rank's KDA heads and, under Helix, its share of each page's latents
    pool_config = replace(config, kda_num_heads=config.kda_num_heads // m.tp)
    # GPU: every rank profiles the same two steps (their collectives meet), then caps its allocator
    profile = profile_memory(model, pool_config, ec, dtype, device, s.max_model_len)
    cap_allocator(ec, device)
    plan = plan_cache(pool_config, ec, dtype, device, s.max_model_len, mla_shards=m.helix,
                      activation_peak=profile.activations if profile else 0)
    group = m.dp == 1 and m.rank == 0
    cache = (lockstep.RecordingCache if group else HybridCache)(
        pool_config, plan.num_pages, plan.page_size, plan.num_slots, plan.num_snapshots, plan.max_pages_per_seq,
        dtype, device, ec.enable_prefix_caching, pool_page_size=plan.page_size // m.helix)
    log.info("rank %d of %s: weights %.1f MiB in %.1f s; %s", m.rank, m.name, nbytes / 2 ** 20,
             time.perf_counter() - t0, plan.describe(config))
    if m.dp == 1 and m.rank != 0:
        steps = lockstep.follow(model, cache.pools, device)
        log.info("rank %d: rank 0 stopped after %d steps", m.rank, steps)
        return None
    eager = replace(ec, enforce_eager=True, async_scheduling=False)
    if group:
        engine = Engine(config, eager, lockstep.LockstepModel(model, cache), cache, s.tokenizer)
        atexit.register(engine.model.stop)
        engine.stop = engine.model.stop
        return engine
    engine = Engine(config, eager, model, cache, s.tokenizer)
    if m.rank != 0:
        lockstep.dp_follow(engine, m.rank)
        return None
    dp = lockstep.DPEngine(engine, m)
    atexit.register(dp.stop)
    return dp


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def check_memory(config: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
                 max_len: int, mapping: Mapping | None = None) -> None:
    """Weights (and on the CPU the cache pools, sized by arithmetic alone) that cannot fit the device are an error
    now, not an allocator failure after minutes of loading. Several ranks: one rank's share against one device."""
    weights = weights_nbytes(config, dtype, mapping, ec.fp8_weight_read)
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


def modeling_context(config: ModelConfig, device: torch.device, dtype: torch.dtype, ec: EngineConfig | None = None,
                     layout: str = "tp1"):
    """What stays fixed for the engine's life, as the router sees it. The kv dtype is the MLA pages' format
    (the model dtype unless `--kv-cache-dtype` / `--kv-cache-dtype-layers` say otherwise; several joined by '+',
    e.g. 'bf16+fp8'; '+kda-bf16' with a bf16 KDA state), so a target that reads only bf16 pages and fp32 states
    declines the others; `layout` the parallel layout (kestrel/parallel/mapping.py), e.g. tp1, dep2; `spec` the
    speculative method (none without --speculative-config; the sm_90 targets claim none, ngram and dspark)."""
    from kestrel.catalog._op import current_arch
    from kestrel.models.kimi.routing import ModelingContext
    fmt = str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
    kv, spec = fmt, "none"
    if ec is not None:
        spec = ec.speculative_config.method if ec.speculative_config else "none"
        kinds = sorted({f.kind for f in cache_formats(config, ec, dtype)[0].values()})
        kv = "+".join(kinds) or fmt
        if ec.kda_state_dtype != "fp32":        # the targets' KDA kernels keep an fp32 state
            kv += f"+kda-{ec.kda_state_dtype}"
    return ModelingContext(config=config, arch=current_arch(device), quant=fmt, kv_cache_dtype=kv,
                            spec=spec, layout=layout)


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
        ec = EngineConfig(model=model, dtype=dtype, device=device, **engine_args)
        self._group = None
        from kestrel.parallel.mapping import env_rank
        if ec.world_size > 1 and env_rank() is None:
            # several ranks from a plain process: every check here, then one process per rank (rank 0 drives)
            s = setup_engine(ec)
            from kestrel.parallel.launch import RankGroup
            self.engine, self.tokenizer, self.config = None, s.tokenizer, s.config
            self._group = RankGroup(ec, _llm_rank)
            self._group.call("ready")          # every rank loaded (or the error of the one that failed)
            import atexit
            atexit.register(self.close)
            return
        self.engine = build_engine(ec)
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config

    @classmethod
    def over(cls, engine) -> "LLM":
        """The offline API over an engine built already (a rank's, in kestrel/parallel)."""
        llm = cls.__new__(cls)
        llm._group, llm.engine, llm.tokenizer, llm.config = None, engine, engine.tokenizer, engine.config
        return llm

    @property
    def rank_pids(self) -> list[int]:
        """The rank processes' ids (several ranks started by this LLM), else []."""
        return self._group.pids if self._group is not None else []

    def close(self) -> None:
        """Stop the rank processes (several ranks); nothing to do on one."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings or token-id lists."""
        if self._group is not None:
            return self._group.call("generate", prompts, params)
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


def _llm_rank(ec: EngineConfig, conn) -> None:
    """One rank process of an `LLM` over several ranks: rank 0 answers the LLM's calls over `conn` and drives the
    others, which follow inside `build_engine` and exit when rank 0 stops."""
    from kestrel.errors import KestrelError
    from kestrel.runtime.lockstep import portable
    logging.basicConfig(level=logging.WARNING, format=f"[rank {os.environ.get('RANK')}] %(name)s: %(message)s")
    try:
        engine = build_engine(ec)
    except KestrelError as e:
        if conn is not None:
            conn.send(("error", e))
        raise SystemExit(2)
    llm = LLM.over(engine)
    while True:
        try:
            name, args = conn.recv()
        except EOFError:          # the LLM's process ended without close(): stop the group all the same
            name = "close"
        if name == "close":
            engine.stop()
            try:
                conn.send(("ok", None))
            except OSError:
                pass
            return
        if name == "ready":
            conn.send(("ok", None))
            continue
        try:
            conn.send(("ok", [portable(o) for o in llm.generate(*args)]))
        except KestrelError as e:
            conn.send(("error", e))
