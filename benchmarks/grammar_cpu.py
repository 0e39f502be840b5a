"""xgrammar vs llguidance on the CPU: grammar compile time and per-token mask fill time.

Measures, for a nested tool-argument JSON schema, (1) the one-off vocabulary setup, (2) compiling the schema into
a per-request matcher, (3) filling one int32 bitmask row [ceil(V/32)] per generated token, on a tiny demo vocabulary
(1,024 ids) and on a Kimi-sized one (163,840 ids, the demo BPE learner grown to that size: real widths, synthetic
pieces). Tokens are drawn by a random "model" (uniform over the allowed ids), so both libraries walk schema-valid
outputs of similar length. One thread (OMP_NUM_THREADS=1 and the libraries' own thread pools at 1).

    OMP_NUM_THREADS=1 python benchmarks/grammar_cpu.py --out benchmarks/results/grammar_cpu.json

`--sampler-only` measures just the engine's sampler step (`Sampler.prepare` + `Sampler.sample`, temperature 1)
at batch 1 and 64 without a grammar and with every row under one (rows filled on the host as `Engine` fills them,
the mask applied inside `sample_rows`, each matcher advanced with its token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel.tokenizer import load_tokenizer, write_demo_tokenizer  # noqa: E402

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "units": {"enum": ["metric", "imperial"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "include_hourly": {"type": "boolean"},
    },
    "required": ["city", "days", "location"],
    "additionalProperties": False,
}


def allowed_ids(row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def bench_llguidance(tok, vocab: int, steps: int, seed: int) -> dict:
    import llguidance as llg
    from llguidance.torch import fill_next_token_bitmask

    from kestrel.serve.chat.grammar import lltokenizer_for

    t0 = time.perf_counter()
    llt = lltokenizer_for(tok, vocab)
    setup = time.perf_counter() - t0
    grammar = llg.grammar_from("json_schema", json.dumps(NESTED_SCHEMA))
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        m = llg.LLMatcher(llt, grammar, log_level=0)
        compiles.append(time.perf_counter() - t0)
    assert not m.is_error(), m.get_error()
    return _walk(m, vocab, steps, seed, setup, compiles,
                 fill=lambda mm, bm: fill_next_token_bitmask(mm, bm, 0),
                 accept=lambda mm, t: mm.consume_token(t),
                 done=lambda mm: mm.is_stopped() or mm.is_accepting(),
                 reset=lambda mm: mm.reset())


def bench_xgrammar(tok, vocab: int, steps: int, seed: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)] + [b""] * (vocab - tok.vocab_size)
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - t0
    compiles = []
    for _ in range(5):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(NESTED_SCHEMA), any_whitespace=False)
        m = xgr.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - t0)
    return _walk(m, vocab, steps, seed, setup, compiles,
                 fill=lambda mm, bm: mm.fill_next_token_bitmask(bm, 0),
                 accept=lambda mm, t: mm.accept_token(t),
                 done=lambda mm: mm.is_terminated(),
                 reset=lambda mm: mm.reset())


def _walk(m, vocab, steps, seed, setup, compiles, fill, accept, done, reset) -> dict:
    gen = torch.Generator().manual_seed(seed)
    bm = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    fills = []
    outputs = 0
    while len(fills) < steps:
        t0 = time.perf_counter()
        fill(m, bm)
        fills.append(time.perf_counter() - t0)
        ids = allowed_ids(bm[0], vocab)
        token = int(ids[torch.randint(len(ids), (1,), generator=gen)])
        accept(m, token)
        if done(m):
            outputs += 1
            reset(m)
    fills.sort()
    return {
        "vocab_setup_s": setup,
        "compile_ms_median": 1e3 * statistics.median(compiles),
        "fill_us_mean": 1e6 * statistics.fmean(fills),
        "fill_us_p50": 1e6 * fills[len(fills) // 2],
        "fill_us_p99": 1e6 * fills[int(len(fills) * 0.99)],
        "steps": steps,
        "outputs_completed": outputs,
    }


def bench_sampler_overhead(tok, vocab: int, batch: int, steps: int) -> dict:
    """One sampling step over [batch, vocab] logits (softmax + argmax) with no grammar, and with every row under a
    grammar: fill the host bitmask rows, apply it, sample, advance each matcher."""
    import llguidance as llg

    from kestrel.serve.chat.grammar import RequestGrammar, allocate_bitmask, apply_bitmask_, fill_bitmasks, \
        lltokenizer_for

    llt = lltokenizer_for(tok, vocab)
    grammar = llg.grammar_from("json_schema", json.dumps(NESTED_SCHEMA))
    grammars = [RequestGrammar(llg.LLMatcher(llt, grammar, log_level=0), vocab) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    bitmask = allocate_bitmask(batch, vocab)
    plain, masked, fills, applies = [], [], [], []
    for _ in range(steps):
        logits = torch.rand(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        logits.softmax(-1).argmax(-1).tolist()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fill_bitmasks(grammars, bitmask)
        t1 = time.perf_counter()
        apply_bitmask_(logits, bitmask)
        t2 = time.perf_counter()
        tokens = logits.softmax(-1).argmax(-1).tolist()
        for g, t in zip(grammars, tokens):
            g.accept(t)
            if g.is_finished:
                g.matcher.reset()
        masked.append(time.perf_counter() - t0)
        fills.append(t1 - t0)
        applies.append(t2 - t1)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"batch": batch, "vocab": vocab, "plain_ms": med(plain), "grammar_ms": med(masked),
            "fill_ms": med(fills), "apply_ms": med(applies)}


def bench_engine_sampler(tok, vocab: int, batch: int, steps: int) -> dict:
    """The engine's sampler step at [batch, vocab]: median ms without a grammar, with every row constrained (host
    fill + device sample with the mask + accept), and the fill alone."""
    import llguidance as llg

    from kestrel.runtime.sampler import Sampler
    from kestrel.sampling_params import SamplingParams
    from kestrel.serve.chat.grammar import RequestGrammar, allocate_bitmask, lltokenizer_for

    llt = lltokenizer_for(tok, vocab)
    grammar = llg.grammar_from("json_schema", json.dumps(NESTED_SCHEMA))
    grammars = [RequestGrammar(llg.LLMatcher(llt, grammar, log_level=0), vocab) for _ in range(batch)]
    sampler = Sampler(batch, vocab, torch.device("cpu"))
    rows = [sampler.row(SamplingParams(temperature=1.0), seed=i) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    bitmask = allocate_bitmask(batch, vocab)
    plain, masked, fills = [], [], []
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        sampler.sample(logits, sampler.prepare(rows, [step] * batch, None)).token_ids.tolist()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        flags = sampler.prepare(rows, [step] * batch, None)
        for b, g in enumerate(grammars):
            g.fill(bitmask[b])
        t1 = time.perf_counter()
        tokens = sampler.sample(logits, flags, bitmask).token_ids.tolist()
        for g, t in zip(grammars, tokens):
            assert g.accept(t), g.error
            if g.is_finished:
                g.matcher.reset()
        masked.append(time.perf_counter() - t0)
        fills.append(t1 - t0)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"batch": batch, "vocab": vocab, "no_grammar_ms": med(plain), "grammar_ms": med(masked),
            "fill_ms": med(fills)}


def sampler_only(steps: int, out: str | None) -> None:
    results = []
    with tempfile.TemporaryDirectory() as d:
        for vocab in (1024, 163_840):
            write_demo_tokenizer(f"{d}/v{vocab}", vocab)
            tok = load_tokenizer(f"{d}/v{vocab}")
            results += [bench_engine_sampler(tok, vocab, b, steps) for b in (1, 64)]
    print(f"{'vocab':>7} {'batch':>5} {'no grammar ms':>14} {'grammar ms':>11} {'of which fill':>14}")
    for r in results:
        print(f"{r['vocab']:>7} {r['batch']:>5} {r['no_grammar_ms']:>14.2f} {r['grammar_ms']:>11.2f} "
              f"{r['fill_ms']:>14.2f}")
    if out:
        Path(out).write_text(json.dumps({"schema": NESTED_SCHEMA, "engine_sampler": results}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sampler-only", action="store_true", help="only the engine sampler step, with and without")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.sampler_only:
        return sampler_only(min(args.steps, 50), args.out)
    rows, sampler = [], []
    with tempfile.TemporaryDirectory() as d:
        for vocab in (1024, 163_840):
            write_demo_tokenizer(f"{d}/v{vocab}", vocab)
            tok = load_tokenizer(f"{d}/v{vocab}")
            for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
                r = fn(tok, vocab, args.steps, seed=0)
                r.update(library=name, vocab=vocab)
                rows.append(r)
            if vocab > 1024:
                sampler = [bench_sampler_overhead(tok, vocab, b, 50) for b in (1, 64)]
    print(f"{'library':<11} {'vocab':>7} {'setup s':>8} {'compile ms':>11} {'fill us mean':>13} "
          f"{'p50':>8} {'p99':>8} {'outputs':>8}")
    for r in rows:
        print(f"{r['library']:<11} {r['vocab']:>7} {r['vocab_setup_s']:>8.3f} {r['compile_ms_median']:>11.2f} "
              f"{r['fill_us_mean']:>13.1f} {r['fill_us_p50']:>8.1f} {r['fill_us_p99']:>8.1f} "
              f"{r['outputs_completed']:>8}")
    print(f"\nsampler step, V={sampler[0]['vocab']} (llguidance, every row constrained; median ms)")
    print(f"{'batch':>5} {'no grammar':>11} {'grammar':>9} {'of which fill':>14} {'apply':>7}")
    for r in sampler:
        print(f"{r['batch']:>5} {r['plain_ms']:>11.2f} {r['grammar_ms']:>9.2f} {r['fill_ms']:>14.2f} "
              f"{r['apply_ms']:>7.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"schema": NESTED_SCHEMA, "rows": rows, "sampler": sampler},
                                             indent=2) + "\n")


if __name__ == "__main__":
    main()
