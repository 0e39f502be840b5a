"""`kestrel bench serve`: a load generator for an OpenAI-compatible server.

It sends `--num-prompts` streaming /v1/completions requests, at most `--concurrency` at a time and, with
`--request-rate R`, started as a Poisson process of R requests per second. Prompts are random token ids of
`--input-len` tokens (the vocabulary size comes from /v1/models, or `--vocab-size`) or the lines of a JSONL file
(`{"prompt": "text" | [token ids], "max_tokens": optional}`). Each request asks for `--output-len` tokens with
`ignore_eos`, so every request generates exactly that many.

Every stream is checked: HTTP 200, `data: ` events of JSON objects, one choice that finishes exactly once, a usage
chunk that agrees with the tokens streamed, and `data: [DONE]` at the end with nothing after it. A request that
fails any check counts as an error (with its message), never as a result.

Reported: request and token throughput, and mean / p50 / p90 / p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, between streamed chunks) and end-to-end latency.
A table goes to stdout and everything to `--out` as JSON; `--save-outputs` keeps each request's prompt, seed,
text and token ids in the JSON too (to compare with an offline run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from kestrel.errors import KestrelError

PERCENTILES = (50, 90, 99)


@dataclass
class RequestSpec:
    index: int
    prompt: str | list[int]
    max_tokens: int
    seed: int | None = None


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None              # seconds
    latency: float | None = None           # seconds, send to [DONE]
    itl: list[float] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    started: float = 0.0                   # seconds since the benchmark's start


class StreamError(Exception):
    pass


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def server_info(client, url: str, api_key: str | None) -> dict:
    """The first model card of GET /v1/models."""
    r = await client.get(f"{_base(url)}/v1/models", headers=_headers(api_key))
    if r.status_code != 200:
        raise KestrelError(f"GET {_base(url)}/v1/models answered {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data:
        raise KestrelError(f"GET {_base(url)}/v1/models lists no model")
    return data[0]


async def _one(client, url: str, model: str | None, spec: RequestSpec, args_extra: dict, api_key: str | None,
               t0: float, keep_text: bool) -> RequestResult:
    res = RequestResult(spec.index)
    payload = {"prompt": spec.prompt, "max_tokens": spec.max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, **args_extra}
    if model:
        payload["model"] = model
    if spec.seed is not None:
        payload["seed"] = spec.seed
    start = time.perf_counter()
    res.started = start - t0
    last = None
    text_parts: list[str] = []
    ids: list[int] = []
    saw_ids = False
    usage = None
    done = False
    finished = 0
    try:
        async with client.stream("POST", f"{_base(url)}/v1/completions", json=payload,
                                 headers=_headers(api_key)) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                raise StreamError(f"HTTP {resp.status_code}: {_error_message(body)}")
            ctype = resp.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                raise StreamError(f"content-type is {ctype!r}, not text/event-stream")
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.strip():
                    continue
                if done:
                    raise StreamError(f"data after [DONE]: {line[:100]!r}")
                if not line.startswith("data: "):
                    raise StreamError(f"a line that is not a `data: ` event: {line[:100]!r}")
                data = line[6:]
                if data.strip() == "[DONE]":
                    done = True
                    continue
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    raise StreamError(f"an event that is not JSON: {data[:100]!r}") from None
                if not isinstance(obj, dict):
                    raise StreamError(f"an event that is not a JSON object: {data[:100]!r}")
                if "error" in obj:
                    raise StreamError(f"error event: {_error_message(json.dumps(obj))}")
                choices = obj.get("choices")
                if not isinstance(choices, list):
                    raise StreamError("an event without a `choices` array")
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in choices:
                    if ch.get("index") != 0:
                        raise StreamError(f"a choice with index {ch.get('index')!r} (n = 1 was asked)")
                    if finished:
                        raise StreamError("a choice chunk after the choice finished")
                    t = ch.get("text")
                    if not isinstance(t, str):
                        raise StreamError("a choice without a `text` string")
                    new_ids = ch.get("token_ids")
                    if new_ids is not None:
                        saw_ids = True
                        ids += new_ids
                    if t or new_ids:
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                    text_parts.append(t)
                    if ch.get("finish_reason") is not None:
                        finished += 1
                        res.finish_reason = ch["finish_reason"]
        if not done:
            raise StreamError("the stream ended without `data: [DONE]`")
        if finished != 1:
            raise StreamError("the choice never finished (no finish_reason)")
        if usage is None:
            raise StreamError("no usage chunk although stream_options.include_usage was set")
        res.output_tokens = int(usage.get("completion_tokens", 0))
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
        if saw_ids and len(ids) != res.output_tokens:
            raise StreamError(f"{len(ids)} token ids streamed but usage says {res.output_tokens} completion tokens")
        if res.ttft is None and res.output_tokens:
            raise StreamError("usage counts completion tokens but no token was streamed")
        res.latency = time.perf_counter() - start
        res.ok = True
    except StreamError as e:
        res.error = str(e)
    except Exception as e:             # connection refused, reset, timeout ...
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if keep_text:
        res.text = "".join(text_parts)
        res.token_ids = ids if saw_ids else None
    return res


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except Exception:
        return body[:200]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "count": 0}
    return {"mean": 1000 * sum(values) / len(values), **{f"p{q}": 1000 * percentile(values, q) for q in PERCENTILES},
            "count": len(values)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "completed": len(ok), "errors": len(results) - len(ok), "duration_s": duration,
        "input_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": _stats_ms([r.latency for r in ok]),
        "error_messages": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:20]),
    }


async def run_benchmark(url: str, specs: list[RequestSpec], concurrency: int, request_rate: float = math.inf,
                        model: str | None = None, api_key: str | None = None, temperature: float = 0.0,
                        ignore_eos: bool = True, token_ids: bool = True, keep_text: bool = False, seed: int = 0,
                        timeout: float = 600.0) -> tuple[dict, list[RequestResult]]:
    import httpx
    extra = {"temperature": temperature, "ignore_eos": ignore_eos}
    if token_ids:
        extra["return_token_ids"] = True
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def guarded(spec: RequestSpec) -> RequestResult:
            async with sem:
                return await _one(client, url, model, spec, extra, api_key, t0, keep_text)

        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(guarded(spec)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration), list(results)


def random_specs(num: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                 sampling_seed: int | None = None) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [RequestSpec(i, [rng.randrange(vocab_size) for _ in range(input_len)], output_len,
                        None if sampling_seed is None else sampling_seed + i) for i in range(num)]


def dataset_specs(path: str, num: int, output_len: int, sampling_seed: int | None = None) -> list[RequestSpec]:
    rows = []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise KestrelError(f"--dataset {path}:{lineno}: not JSON ({e.msg}); one JSON object per line")
                prompt = row.get("prompt") if isinstance(row, dict) else None
                if not (isinstance(prompt, str) and prompt) and not (
                        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                    raise KestrelError(f"--dataset {path}:{lineno}: needs a `prompt` (a string or token ids)")
                mt = row.get("max_tokens", row.get("output_len", output_len))
                if not isinstance(mt, int) or mt < 1:
                    raise KestrelError(f"--dataset {path}:{lineno}: `max_tokens` must be an integer >= 1")
                rows.append((prompt, mt))
    except OSError as e:
        raise KestrelError(f"--dataset {path}: cannot read it ({e.strerror})")
    if not rows:
        raise KestrelError(f"--dataset {path}: no prompts in it")
    return [RequestSpec(i, rows[i % len(rows)][0], rows[i % len(rows)][1],
                        None if sampling_seed is None else sampling_seed + i) for i in range(num)]


def format_table(summary: dict, title: str = "Serving benchmark") -> str:
    w = 44
    lines = [f"{' ' + title + ' ':=^{w + 40}}"]

    def row(name, value):
        lines.append(f"{name:<{w}}{value:>40}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["errors"])
    row("Duration (s):", f"{summary['duration_s']:.2f}")
    row("Input tokens:", summary["input_tokens"])
    row("Output tokens:", summary["output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")
    lines.append(f"{'(ms)':<{w}}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99")))
    for key, name in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token"),
                      ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        s = summary[key]
        cells = [s["mean"]] + [s[f"p{q}"] for q in PERCENTILES]
        lines.append(f"{name:<{w}}" + "".join(f"{'-' if c is None else f'{c:.2f}':>10}" for c in cells))
    if summary["error_messages"]:
        lines.append("Errors:")
        for msg, n in summary["error_messages"].items():
            lines.append(f"  {n} x {msg}")
    lines.append("=" * (w + 40))
    return "\n".join(lines)


# ---- CLI ---------------------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests started per second, Poisson arrivals (default: all at once, up to --concurrency)")
    p.add_argument("--dataset", default=None, help="JSONL of {\"prompt\": text or token ids, \"max_tokens\"?}")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--vocab-size", type=int, default=None, help="for random prompts (default: from /v1/models)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="request i is sent with seed = this + i")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival times")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at end-of-sequence")
    p.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for `return_token_ids` (for servers without that extension)")
    p.add_argument("--save-outputs", action="store_true", help="keep each request's prompt, text and token ids "
                                                               "in the JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def register_serve(bench_subparsers) -> None:
    """Add `serve` to the subcommands of `kestrel bench`."""
    p = bench_subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (streaming completions)",
                                    description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "input_len", "output_len", "concurrency"):
        if getattr(args, name) < 1:
            raise KestrelError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise KestrelError("--request-rate must be > 0 (leave it out for no limit)")
    result = asyncio.run(_bench(args))
    print(format_table(result["summary"]))
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if result["summary"]["errors"] == 0 else 1


async def _bench(args: argparse.Namespace) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=30.0) as client:
        try:
            info = await server_info(client, args.url, args.api_key)
        except httpx.HTTPError as e:
            raise KestrelError(f"--url {args.url}: cannot reach the server ({type(e).__name__}: {e})")
    model = args.model or info.get("id")
    if args.dataset:
        specs = dataset_specs(args.dataset, args.num_prompts, args.output_len, args.sampling_seed)
    else:
        vocab = args.vocab_size or info.get("vocab_size")
        if not vocab:
            raise KestrelError("the server's /v1/models does not say its vocab_size: give --vocab-size")
        specs = random_specs(args.num_prompts, args.input_len, args.output_len, vocab, args.seed, args.sampling_seed)
    summary, results = await run_benchmark(
        args.url, specs, args.concurrency, args.request_rate, model=model, api_key=args.api_key,
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos, token_ids=not args.no_token_ids,
        keep_text=args.save_outputs, seed=args.seed, timeout=args.timeout)
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k not in ("func", "api_key") and not callable(v)}
    config["model"] = model
    out = {"config": config, "summary": summary}
    if args.save_outputs:
        out["requests"] = [{**asdict(r), "prompt": s.prompt, "seed": s.seed, "max_tokens": s.max_tokens}
                           for r, s in zip(results, specs)]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m kestrel.bench.serve ...`, the same as `kestrel bench serve ...`."""
    ap = argparse.ArgumentParser(prog="kestrel bench serve", description=__doc__.split("\n\n")[1])
    add_args(ap)
    args = ap.parse_args(argv)
    try:
        return cmd_bench_serve(args)
    except KestrelError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
