"""`kestrel generate | serve | bench | eval | explain | make-checkpoint | quantize | plan | train-drafter`.

Errors a user can cause print one line (`kestrel: error: ...`) and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys

from kestrel.errors import KestrelError

DEMO_PRESET = "k3-tiny"


def demo_model_dir() -> str:
    root = os.environ.get("KESTREL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "kestrel"))
    return os.path.join(root, f"demo-{DEMO_PRESET}")


def ensure_demo_model() -> str:
    """The built-in demo model: a tiny K3-shaped checkpoint with random weights, made once."""
    path = demo_model_dir()
    if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        import torch
        from kestrel.models.kimi.checkpoint import make_checkpoint
        logging.getLogger("kestrel").info("making the demo model (tiny K3 shape, random weights) in %s", path)
        tmp = f"{path}.tmp{os.getpid()}"
        make_checkpoint(DEMO_PRESET, tmp, seed=0, dtype=torch.float32)
        try:
            os.replace(tmp, path)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="checkpoint directory (default: the built-in demo model, random weights)")
    g.add_argument("--load-format", default="auto", choices=["auto", "random"],
                   help="auto: read the checkpoint's safetensors; random: seeded trained-like random weights drawn "
                        "on the device (the folder needs only config.json; --seed picks the weights)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest context served (default and upper bound: the model's max_position_embeddings)")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="pool size in tokens (CPU default 65536)")
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="pool size in bytes, KDA state slots included")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of the GPU, in (0, 1]")
    g.add_argument("--memory-reserve", type=float, default=1.0, help="GiB kept outside the allocator's cap")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no decode CUDA graphs: every step runs eagerly (vLLM's flag)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each pure-decode step before the host has read the previous step's tokens, so the "
                        "host's bookkeeping overlaps the GPU (default: on where CUDA graphs are on; vLLM's flag)")
    g.add_argument("--modeling", default="auto", choices=["off", "auto", "require"])
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "nvfp4"],
                   help="MLA latent pages: auto = the model dtype; fp8 = e4m3 + fp32 scale per 128 channels (1.76x "
                        "the tokens of bf16 at real widths); nvfp4 = e2m1 + e4m3 per 16 + fp32 per token (2.67x)")
    g.add_argument("--kv-cache-dtype-layers", default=None, metavar="LAYERS:DTYPE[;...]",
                   help="per-layer override of --kv-cache-dtype, 0-based MLA layer indices: '91,92:fp8' (K3's "
                        "last two MLA layers), '3-11:nvfp4;91,92:fp8'")
    g.add_argument("--kda-state-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="KDA recurrent state slots (bf16 halves them)")
    g.add_argument("--fp8-weight-read", default="none",
                   help="none | moe-mlp: store the bf16 shared-expert and latent-MoE projections as FP8 e4m3 with a "
                        "scale per output channel at load (lossy; about half their bytes)")
    g.add_argument("--seed", type=int, default=0, help="seed of request seeds and of --load-format random weights")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "dspark", "model": DIR, "num_speculative_tokens": 7}\' (README: Speculative '
                        'decoding)')
    par = p.add_argument_group("several ranks (one process each; kestrel starts them, or run under torchrun)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="attention heads, dense MLPs and experts split over N ranks")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="attention data-parallel over N ranks, each with its own requests (DEP with "
                          "--enable-expert-parallel)")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="routed experts split whole over the ranks (with token dispatch under data parallelism)")
    par.add_argument("--helix-size", "--decode-context-parallel-size", dest="helix_size", type=int, default=1,
                     help="Helix: the MLA KV cache sharded along the sequence over N ranks (KDA layers and FFN "
                          "tensor- / expert-parallel over the same ranks)")
    par.add_argument("--moe-tp-size", type=int, default=None,
                     help="ranks sharing each routed expert's channels (the rest of the ranks split the experts)")
    par.add_argument("--nnodes", type=int, default=1, help="hosts of the group (this host runs its share)")
    par.add_argument("--node-rank", type=int, default=0, help="this host's index among --nnodes")
    par.add_argument("--master-addr", default="127.0.0.1", help="address of the first host (the rendezvous)")
    par.add_argument("--master-port", type=int, default=None,
                     help="rendezvous port on the first host (default: a free one; needed with --nnodes > 1)")


PARALLEL_FLAGS = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "helix_size", "moe_tp_size",
                  "nnodes", "node_rank", "master_addr", "master_port")


def engine_config(args: argparse.Namespace):
    """The EngineConfig of the engine flags, every value checked (a ConfigError naming the flag) before the demo
    model is made or any weight is read."""
    from kestrel.config import EngineConfig
    ec = EngineConfig(model=args.model or demo_model_dir(), dtype=args.dtype, device=args.device,
                      max_model_len=args.max_model_len, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_tokens=args.kv_cache_tokens,
                      kv_cache_bytes=getattr(args, "kv_cache_bytes", None),
                      gpu_memory_utilization=args.gpu_memory_utilization, memory_reserve_gib=args.memory_reserve,
                      enable_prefix_caching=not args.no_prefix_caching, modeling=args.modeling, seed=args.seed,
                      load_format=getattr(args, "load_format", "auto"),
                      enforce_eager=getattr(args, "enforce_eager", False),
                      async_scheduling=getattr(args, "async_scheduling", None),
                      kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                      kv_cache_dtype_layers=getattr(args, "kv_cache_dtype_layers", None),
                      kda_state_dtype=getattr(args, "kda_state_dtype", "fp32"),
                      fp8_weight_read=getattr(args, "fp8_weight_read", "none"),
                      speculative_config=getattr(args, "speculative_config", None),
                      **{k: getattr(args, k) for k in PARALLEL_FLAGS if hasattr(args, k)})
    if not args.model:
        ensure_demo_model()
    return ec


# Characters printed escaped: C0 / C1 controls but newline and tab (ESC starts terminal control sequences, CR
# overwrites the line), bidirectional overrides (they reorder what the terminal shows) and lone surrogates (they
# cannot be encoded at all).
_ESCAPED = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
            for c in [*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A),
                      *range(0xD800, 0xE000)] if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    """Model text made safe to print on a terminal: control characters escaped (`\\x1b`), newlines and tabs kept."""
    return text.translate(_ESCAPED)


def _sampling_params(args: argparse.Namespace):
    from kestrel.sampling_params import SamplingParams
    if args.seed_sampling is not None and not 0 <= args.seed_sampling < 2 ** 64:
        raise KestrelError(f"--seed-sampling {args.seed_sampling}: must be an integer in 0..2**64-1")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed_sampling, stop=args.stop or None,
                          ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from kestrel.llm import build_engine, setup_engine
    params = _sampling_params(args)          # every flag is checked before the weights are read
    setup = setup_engine(engine_config(args), needs_tokenizer=True)      # the prompt is text
    tok = setup.tokenizer
    if args.chat and not tok.has_chat_template:
        raise KestrelError("--chat: this checkpoint has no chat template")
    engine = build_engine(setup)
    prompt = " ".join(args.prompt)
    if args.chat:
        prompt = tok.encode_chat([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(printable(out.delta_text))
                sys.stdout.flush()
    out = engine.final_output(rid)
    sys.stdout.write("\n")
    m = out.metrics
    logging.getLogger("kestrel").info("%d prompt + %d generated tokens, finish_reason=%s", m.prompt_tokens,
                                      m.generated_tokens, out.finish_reason)
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    import torch
    from kestrel.models.kimi.checkpoint import make_checkpoint
    log = logging.getLogger("kestrel")
    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}[args.dtype]
    if args.layers is not None and args.layers < 1:
        raise KestrelError(f"--layers {args.layers}: a model needs at least one layer")
    try:
        make_checkpoint(args.preset, args.out, layers=args.layers, seed=args.seed, dtype=dtype,
                        progress=lambda i, n: log.info("wrote shard %d/%d", i, n), config_only=args.config_only,
                        quant=args.quant, quant_layout=args.quant_layout)
    except OSError as e:
        raise KestrelError(f"--out {args.out}: cannot write the checkpoint there ({e.strerror or e}); "
                           "choose a writable directory")
    if args.config_only:
        log.info("config of %s%s written to %s (no weights: run it with --load-format random)", args.preset,
                 f", {args.layers} layers" if args.layers else "", args.out)
    else:
        log.info("checkpoint %s (%s%s%s) written to %s", args.preset, args.dtype,
                 f", {args.quant} routed experts" if args.quant else "",
                 f", {args.layers} layers" if args.layers else "", args.out)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from kestrel.config import ModelConfig
    from kestrel.llm import modeling_context, resolve_device, resolve_dtype
    from kestrel.models.kimi.routing import explain
    ec = engine_config(args)
    config = ModelConfig.from_dir(ec.model)
    ec.check_model(config)
    device = resolve_device(ec.device)
    from kestrel.parallel.mapping import Mapping
    layout = Mapping.from_engine_config(ec).name
    text = explain(modeling_context(config, device, resolve_dtype(ec.dtype, device), ec, layout), ec.modeling)
    print(text)
    return 2 if "decision: error" in text else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kestrel", description="Inference engine for Kimi Linear and Kimi K3.")
    ap.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_engine_args(g)
    g.add_argument("prompt", nargs="+")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed-sampling", type=int, default=None, help="seed of the sampling draws")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint in Moonshot's layout")
    from kestrel.models.kimi.checkpoint import PRESETS
    m.add_argument("--preset", required=True, choices=sorted(PRESETS))
    m.add_argument("--layers", type=int, default=None, help="keep the widths, use N layers")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "bfloat16", "float32"])
    m.add_argument("--out", required=True)
    m.add_argument("--config-only", action="store_true",
                   help="write config.json and the tokenizer only, for --load-format random (no weights)")
    m.add_argument("--quant", default=None, choices=["mxfp4", "nvfp4", "mxfp8", "fp8"],
                   help="store the routed experts in this format (K3's layout: quantized experts, bf16 trunk), as "
                        "`kestrel quantize --modules experts` would")
    m.add_argument("--quant-layout", default="compressed-tensors", choices=["compressed-tensors", "modelopt"])
    m.set_defaults(func=cmd_make_checkpoint)

    e = sub.add_parser("explain", help="print how the router chooses a fast path for this checkpoint and engine")
    add_engine_args(e)
    e.set_defaults(func=cmd_explain)

    for register in _optional_commands():
        register(sub, add_engine_args)
    return ap


def _optional_commands():
    """Subcommands that live with what they drive (server, benchmarks, evaluation, quantizer, deployment plan)."""
    import importlib
    for mod in ("kestrel.serve.cli", "kestrel.bench.cli", "kestrel.eval.cli", "kestrel.quant.quantize",
                "kestrel.parallel.plan", "kestrel.spec.train"):
        try:
            yield importlib.import_module(mod).register
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def launch_ranks(args: argparse.Namespace, argv: list[str]) -> int | None:
    """A layout of several ranks asked of `generate` / `serve` from a plain process: check everything here, then
    start this host's ranks and supervise them (kestrel/parallel/launch.py). None: run the command in this
    process (one rank, or one rank of a group torchrun or this launcher started)."""
    from kestrel.parallel.mapping import env_rank
    if args.command not in ("generate", "serve") or env_rank() is not None:
        return None
    ec = engine_config(args)
    if ec.world_size == 1:
        return None
    from kestrel.llm import setup_engine
    from kestrel.parallel.launch import launch_cli
    setup_engine(ec)          # flags, config, heads / experts split, tokenizer, memory: before any rank starts
    return launch_cli(argv, ec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format=prefix + "%(name)s: %(message)s",
                        stream=sys.stderr)
    for noisy in ("httpx", "httpcore"):   # one INFO line per HTTP request would land inside progress bars
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        launched = launch_ranks(args, argv)
        return launched if launched is not None else args.func(args)
    except KestrelError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
