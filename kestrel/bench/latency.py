"""`kestrel bench latency`: one batch of B random prompts of I tokens, generating O tokens each (vLLM's
`bench latency` shape), timed end to end with the device synchronized.

Each iteration runs the batch twice: once generating O tokens, once generating 1. The 1-token run is prefill plus
one sampled token: prefill rate = B * I / t(1). Decode rate = B * (O - 1) / (t(O) - t(1)): the O - 1 decode steps
alone. Prompts are fresh random ids every run (no prefix-cache hits); a prompt longer than
`--max-num-batched-tokens` is prefilled in chunks, as the engine serves it. `--num-iters-warmup` runs come first and are
not counted (with CUDA graphs captured at start-up, even the first run should be near the steady one).

Next to each rate: the floor of this model on the machine, from the bytes a step must read (weights, and for
decode only the routed experts the batch can touch, the MLA latents of the context and the KDA states) at the HBM
bandwidth and its flops at the bf16 tensor rate (H200: 4.2 TB/s, 770 TFLOP/s; `--hbm-tb-s`, `--tflops`), whichever
is slower. The JSON report is `{"machine", "command", "records"}`, one record per phase.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kestrel.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.2e12           # H200 HBM3e
BF16_FLOPS_PER_S = 770e12          # H200 dense bf16 tensor cores


def machine_info(device: torch.device) -> dict:
    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def command_line() -> str:
    return " ".join(["kestrel"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith("kestrel") \
        else " ".join(sys.argv)


# ---- the floor ---------------------------------------------------------------------------------------------------
@dataclass
class ModelBytes:
    """Parameter counts of a checkpoint, by how a step reads them."""
    dense: int           # every step reads these in full (attention, norms, shared experts, router, lm_head)
    embed: int           # the embedding table: a step reads one row per token
    expert: int          # ONE routed expert of one layer (w1 + w3 + w2)
    moe_layers: int

    @classmethod
    def of(cls, config) -> "ModelBytes":
        from kestrel.models.kimi.weights import expected_tensors
        dense = embed = routed = 0
        for name, place in expected_tensors(config).items():
            n = 1
            for d in place.shape:
                n *= d
            if ".experts." in name and "shared_experts" not in name:
                routed += n
            elif name == "embed_tokens.weight":
                embed += n
            else:
                dense += n
        if config.tie_word_embeddings:
            dense += embed                   # the tied table is the lm_head too: read in full every step
        moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        return cls(dense, embed, routed // max(1, moe * config.num_experts), moe)


# bytes per weight of a quantized routed expert as stored: values and block scales (NVFP4's tensor scale: per row)
STORED_BYTES = {"mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32, "fp8": 1.0}


def expert_bytes_per_weight(config, elt: float) -> float:
    """What a step reads per routed-expert weight: the stored format's bytes for quantized experts (K3's
    checkpoints), else the model dtype's `elt`. The rest of the model is counted at `elt` (bf16 trunk)."""
    from kestrel.models.kimi.weights import quantized_linears
    formats = {s.format for n, s in quantized_linears(config, first_expert_only=True).items() if ".experts." in n}
    return STORED_BYTES[formats.pop()] if len(formats) == 1 else elt


def floor_tokens_per_s(config, phase: str, batch: int, context: int, new_tokens: int, elt: int = 2,
                       hbm: float = HBM_BYTES_PER_S, flops: float = BF16_FLOPS_PER_S) -> float:
    """Tokens per second no implementation can beat on this machine: a decode step of `batch` sequences at
    `context` cached tokens (new_tokens = 1), or a prefill of `batch` prompts of `new_tokens` tokens (context 0)."""
    c = config
    m = ModelBytes.of(c)
    T = batch * new_tokens
    E, k = max(c.num_experts, 1), c.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** T) if c.num_experts else 0     # expected distinct experts per MoE layer
    n_mla, n_kda = len(c.mla_layers), len(c.kda_layers)
    kv = c.mla_cache_width * elt
    state = c.kda_num_heads * c.kda_head_dim ** 2 * 4
    byts = (m.dense + T * c.hidden_size) * elt + m.moe_layers * touched * m.expert * expert_bytes_per_weight(c, elt)
    byts += n_mla * batch * ((context if phase == "decode" else 0) + new_tokens) * kv    # latents read / written
    byts += n_kda * batch * 2 * state                                                    # KDA state in and out
    active = m.dense + m.moe_layers * k * m.expert - (c.vocab_size * c.hidden_size if phase == "prefill" else 0)
    fl = 2 * active * T + 2 * c.vocab_size * c.hidden_size * batch   # prefill computes logits of the last token
    H = c.num_heads
    if phase == "decode":        # absorbed MLA: scores over 576, values over 512, per cached token
        fl += n_mla * batch * 2 * H * (context + 1) * (c.mla_cache_width + c.kv_lora_rank)
    else:                        # causal expanded MLA over each prompt
        fl += n_mla * batch * 2 * H * (c.qk_head_dim + c.v_head_dim) * new_tokens * (new_tokens + 1) / 2
    fl += n_kda * T * 6 * c.kda_num_heads * c.kda_head_dim ** 2                            # state update + readout
    return T / max(byts / hbm, fl / flops)


# ---- the run -----------------------------------------------------------------------------------------------------
def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _timed_run(engine, prompts: list[list[int]], params: SamplingParams) -> float:
    _sync(engine)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    _sync(engine)
    wall = time.perf_counter() - t0
    for r in rids:
        n = len(engine.final_output(r).token_ids)
        if n != params.max_tokens:
            raise RuntimeError(f"a request generated {n} tokens, not {params.max_tokens}: the pool is too small "
                               "for this batch; give the cache more memory or lower --batch-size")
        engine.release(r)
    return wall


def sampling_params(sampling: str, max_tokens: int, seed: int) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True, seed=seed)


def run_latency(engine, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
                num_iters_warmup: int = 1, sampling: str = "greedy", seed: int = 0, model_name: str | None = None,
                weights: str | None = None, hbm: float = HBM_BYTES_PER_S, flops: float = BF16_FLOPS_PER_S) -> dict:
    """The report: machine, command, one decode and one prefill record, and the per-iteration times."""
    if output_len < 2:
        raise ValueError("--output-len must be >= 2: the decode rate is (t(O) - t(1)) / (O - 1)")
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    engine.runner.timed = True                # CUDA events time the model on the device (no extra sync)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(batch_size)]

    from kestrel.bench.throughput import spec_delta, spec_stats
    full, one = [], []
    timing0 = spec0 = None
    for it in range(num_iters_warmup + num_iters):
        if it == num_iters_warmup:
            timing0, spec0 = dict(engine.timing), spec_stats(engine)
        engine.cache.drop_prefix_cache()
        t_full = _timed_run(engine, prompts(), sampling_params(sampling, output_len, seed + it))
        t_one = _timed_run(engine, prompts(), sampling_params(sampling, 1, seed + it))
        if it >= num_iters_warmup:
            full.append(t_full)
            one.append(t_one)
    t_full, t_one = statistics.fmean(full), statistics.fmean(one)
    decode_s = max(t_full - t_one, 1e-12)
    c = engine.config
    elt = torch.empty((), dtype=engine.cache.dtype).element_size()
    name = model_name or os.path.basename(os.path.normpath(engine.engine_config.model))
    wname = weights or str(engine.cache.dtype).replace("torch.", "")
    mean_ctx = input_len + output_len // 2
    base = {"model": name, "weights": wname, "batch": batch_size, "sampling": sampling}
    records = [
        {**base, "phase": "decode", "context": input_len, "output_len": output_len,
         "tokens_per_s": batch_size * (output_len - 1) / decode_s,
         "step_ms": 1e3 * decode_s / (output_len - 1),
         "floor_tokens_per_s": floor_tokens_per_s(c, "decode", batch_size, mean_ctx, 1, elt, hbm, flops)},
        {**base, "phase": "prefill", "prompt_len": input_len,
         "tokens_per_s": batch_size * input_len / t_one,
         "floor_tokens_per_s": floor_tokens_per_s(c, "prefill", batch_size, 0, input_len, elt, hbm, flops)},
    ]
    spec = spec_delta(spec_stats(engine), spec0)
    if spec is not None:     # the decode record's acceptance: tokens per verify block (accepted drafts + 1)
        records[0]["accept_len"] = round(spec["mean_accept_len"], 4)
        records[0]["num_speculative_tokens"] = spec["num_speculative_tokens"]
    for r in records:
        r["ratio_to_floor"] = r["tokens_per_s"] / r["floor_tokens_per_s"]
    phases = {k: round(engine.timing[k] - timing0.get(k, 0.0), 4) for k in engine.timing} if timing0 else {}
    return {"machine": machine_info(engine.device), "command": command_line(), "records": records,
            "runs": {"full_s": [round(t, 5) for t in full], "one_token_s": [round(t, 5) for t in one],
                     "engine_phase_s": phases, "graph_replays": engine.runner.replays,
                     "async_scheduling": engine.async_scheduling,
                     "graphs": len(engine.runner.graphs), "capture_s": round(engine.runner.capture_s, 2),
                     **({"spec": spec} if spec is not None else {})}}


def format_table(report: dict) -> str:
    cols = ["model", "phase", "batch", "len", "sampling", "tok/s", "floor tok/s", "of floor"]
    rows = [[r["model"], r["phase"], str(r["batch"]), str(r.get("context", r.get("prompt_len"))), r["sampling"],
             f"{r['tokens_per_s']:.1f}", f"{r['floor_tokens_per_s']:.1f}", f"{r['ratio_to_floor']:.1%}"]
            for r in report["records"]]
    from kestrel.bench.throughput import spec_line
    line = spec_line(report.get("runs", {}).get("spec"))
    return _table(cols, rows) + (f"\n{line}" if line else "")


def _table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]

    def line(vals):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


# ---- the command -------------------------------------------------------------------------------------------------
def register_latency(bsub, add_engine_args) -> None:
    p = bsub.add_parser("latency", help="one batch: prefill and decode rates against the machine's floor",
                        description="vLLM's `bench latency` shape: B prompts of I random tokens, O new tokens each; "
                                    "decode rate = (t(O) - t(1)) / (O - 1), prefill rate from the 1-token run.")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--sampling", choices=["greedy", "top_p"], default="greedy",
                   help="greedy, or temperature 0.8 / top-p 0.95")
    p.add_argument("--model-name", default=None, help="the record's model name (default: the checkpoint folder)")
    p.add_argument("--weights", default=None, help="the record's weights label (default: the dtype)")
    p.add_argument("--hbm-tb-s", type=float, default=HBM_BYTES_PER_S / 1e12, help="floor: HBM TB/s (H200 4.2)")
    p.add_argument("--tflops", type=float, default=BF16_FLOPS_PER_S / 1e12, help="floor: bf16 TFLOP/s (H200 770)")
    p.add_argument("--out", default="bench-latency.json", help="JSON report path")
    p.set_defaults(func=cmd_latency)


def cmd_latency(args) -> int:
    import logging

    from kestrel.bench.throughput import write_report
    from kestrel.cli import engine_config
    from kestrel.errors import KestrelError
    from kestrel.llm import build_engine
    for name in ("batch_size", "input_len", "num_iters"):
        if getattr(args, name) < 1:
            raise KestrelError(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        raise KestrelError("--output-len must be >= 2 (the decode rate needs t(O) - t(1))")
    if args.num_iters_warmup < 0:
        raise KestrelError("--num-iters-warmup must be >= 0")
    ec = engine_config(args)
    if ec.max_num_seqs < args.batch_size:        # the whole batch decodes together
        logging.getLogger("kestrel.bench").info("--max-num-seqs raised to the batch size %d", args.batch_size)
        ec.max_num_seqs = args.batch_size
    engine = build_engine(ec)
    report = run_latency(engine, args.batch_size, args.input_len, args.output_len, args.num_iters,
                         args.num_iters_warmup, args.sampling, args.seed, args.model_name, args.weights,
                         args.hbm_tb_s * 1e12, args.tflops * 1e12)
    print(format_table(report))
    write_report(report, args.out)
    logging.getLogger("kestrel.bench").info("wrote %s", args.out)
    return 0
