"""GSM8K over a running OpenAI-compatible server, scored the standard way (strict-match exact match).

Data: a local JSONL in the dataset's own format, one `{"question": ..., "answer": ...}` per line, the answer being
the worked solution that ends with `#### <number>`. Nothing is downloaded.

Prompt (k-shot, the usual GSM8K form): each shot is `Question: <q>\\nAnswer: <full worked answer>`, shots and
the test question are joined by a blank line, and the prompt ends with `Question: <q>\\nAnswer:`. Shots are the
first k lines of `--fewshot-data`, or else the first k lines of `--data` (which are then not evaluated). Greedy
decoding, up to `--max-tokens` tokens, stopping at `Question:`, `</s>` or `<|im_end|>`.

Scoring:
- the reference is the text after `####` in the answer;
- strict-match: the first match of `#### (\\-?[0-9\\.\\,]+)` in the response (the score);
- flexible-extract: the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)` in the response (reported beside it);
- a prediction equals the reference when both are equal after removing `,` and `$`, surrounding whitespace and
  one trailing `.`, ignoring case.
The standard error is that of a mean of 0/1 outcomes, sqrt(p (1 - p) / (n - 1)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time

from kestrel.errors import KestrelError

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
STOP = ["Question:", "</s>", "<|im_end|>"]
INVALID = "[invalid]"


def normalize(s: str | None) -> str | None:
    if s is None:
        return None
    s = s.replace(",", "").replace("$", "").strip()
    if s.endswith("."):
        s = s[:-1]
    return s.strip().lower()


def reference_answer(answer: str) -> str:
    """The number after '####' in a GSM8K solution."""
    i = answer.rfind("####")
    if i < 0:
        raise ValueError("no '####' in the answer")
    return answer[i + 4:].strip()


def extract_strict(response: str) -> str | None:
    m = STRICT_RE.search(response)
    return m.group(1) if m else None


def extract_flexible(response: str) -> str | None:
    matches = FLEXIBLE_RE.findall(response)
    if not matches:
        return None
    last = matches[-1]
    return next((g for g in last if g), None)


def is_correct(prediction: str | None, reference: str) -> bool:
    return prediction is not None and normalize(prediction) == normalize(reference)


def doc_text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def build_prompt(shots: list[dict], question: str) -> str:
    parts = [f"{doc_text(s['question'])} {s['answer']}" for s in shots]
    parts.append(doc_text(question))
    return "\n\n".join(parts)


def load_jsonl(path: str, flag: str = "--data") -> list[dict]:
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise KestrelError(f"{flag} {path}: cannot read it ({e.strerror})")
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise KestrelError(f"{flag} {path}:{lineno}: not JSON ({e.msg}); GSM8K files have one "
                                   "{\"question\", \"answer\"} object per line")
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                raise KestrelError(f"{flag} {path}:{lineno}: needs string fields `question` and `answer`")
            if "####" not in row["answer"]:
                raise KestrelError(f"{flag} {path}:{lineno}: the answer has no '#### <number>' final line")
            rows.append({"question": row["question"], "answer": row["answer"]})
    if not rows:
        raise KestrelError(f"{flag} {path}: no examples in it")
    return rows


def split_examples(data: list[dict], num_fewshot: int, fewshot_data: list[dict] | None,
                   limit: int | None) -> tuple[list[dict], list[dict]]:
    """(shots, examples to evaluate)."""
    if fewshot_data is not None:
        if len(fewshot_data) < num_fewshot:
            raise KestrelError(f"--fewshot-data has {len(fewshot_data)} examples, fewer than --num-fewshot "
                               f"{num_fewshot}")
        shots, evals = fewshot_data[:num_fewshot], data
    else:
        if len(data) <= num_fewshot:
            raise KestrelError(f"--data has {len(data)} examples: the first --num-fewshot {num_fewshot} are the "
                               "shots, which leaves none to evaluate; give a --fewshot-data file or lower "
                               "--num-fewshot")
        shots, evals = data[:num_fewshot], data[num_fewshot:]
    if limit is not None:
        evals = evals[:limit]
    return shots, evals


def stderr_of_mean(p: float, n: int) -> float | None:
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None


def score(examples: list[dict], responses: list[str]) -> tuple[dict, list[dict]]:
    samples = []
    for ex, resp in zip(examples, responses):
        ref = reference_answer(ex["answer"])
        strict, flexible = extract_strict(resp), extract_flexible(resp)
        samples.append({"question": ex["question"], "reference": ref, "response": resp,
                        "strict": strict if strict is not None else INVALID,
                        "flexible": flexible if flexible is not None else INVALID,
                        "strict_correct": is_correct(strict, ref), "flexible_correct": is_correct(flexible, ref)})
    n = len(samples)
    strict_acc = sum(s["strict_correct"] for s in samples) / n
    flex_acc = sum(s["flexible_correct"] for s in samples) / n
    results = {"task": "gsm8k", "n": n, "score": strict_acc,
               "strict_match": strict_acc, "strict_match_stderr": stderr_of_mean(strict_acc, n),
               "flexible_extract": flex_acc, "flexible_extract_stderr": stderr_of_mean(flex_acc, n)}
    return results, samples


class _Client:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        import httpx
        url = url.rstrip("/")
        self.base = url[:-3] if url.endswith("/v1") else url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0))

    async def model(self) -> str:
        import httpx
        try:
            r = await self.http.get(f"{self.base}/v1/models", headers=self.headers)
        except httpx.HTTPError as e:
            raise KestrelError(f"--url {self.base}: cannot reach the server ({type(e).__name__}: {e})")
        if r.status_code != 200:
            raise KestrelError(f"GET {self.base}/v1/models answered {r.status_code}: {_message(r.text)}")
        data = r.json().get("data") or []
        if not data:
            raise KestrelError(f"GET {self.base}/v1/models lists no model; give --model")
        return data[0]["id"]

    async def complete(self, payload: dict, retries: int = 3) -> str:
        import httpx
        for attempt in range(retries + 1):
            try:
                r = await self.http.post(f"{self.base}/v1/completions", json=payload, headers=self.headers)
            except httpx.HTTPError as e:
                if attempt == retries:
                    raise KestrelError(f"POST {self.base}/v1/completions failed {retries + 1} times: "
                                       f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.5 * 2 ** attempt)
                continue
            if r.status_code == 200:
                try:
                    return r.json()["choices"][0]["text"]
                except (ValueError, KeyError, IndexError, TypeError):
                    raise KestrelError(f"POST {self.base}/v1/completions answered 200 without choices[0].text")
            if r.status_code < 500 or attempt == retries:
                raise KestrelError(f"POST {self.base}/v1/completions answered {r.status_code}: {_message(r.text)}")
            await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.http.aclose()


def _message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except Exception:
        return body[:300]


async def evaluate(url: str, examples: list[dict], shots: list[dict], concurrency: int = 16,
                   max_tokens: int = 256, model: str | None = None, api_key: str | None = None,
                   progress: bool = True, timeout: float = 600.0) -> tuple[dict, list[dict]]:
    """Query the server for every example (greedy) and score the responses."""
    from tqdm import tqdm
    client = _Client(url, api_key, timeout)
    try:
        model = model or await client.model()
        sem = asyncio.Semaphore(concurrency)
        responses: list[str | None] = [None] * len(examples)
        bar = tqdm(total=len(examples), desc="gsm8k", unit="q", disable=not progress, file=sys.stderr)

        async def one(i: int, ex: dict) -> None:
            async with sem:
                payload = {"model": model, "prompt": build_prompt(shots, ex["question"]), "max_tokens": max_tokens,
                           "temperature": 0.0, "stop": STOP}
                responses[i] = await client.complete(payload)
                bar.update(1)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(i, ex)) for i, ex in enumerate(examples)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        elapsed = time.perf_counter() - t0
    finally:
        await client.close()
    results, samples = score(examples, responses)
    results.update({"model": model, "num_fewshot": len(shots), "elapsed_s": elapsed})
    return results, samples


def format_results(r: dict) -> str:
    def pm(acc, se):
        return f"{acc:.4f} ± {se:.4f}" if se is not None else f"{acc:.4f}"
    return (f"gsm8k ({r['num_fewshot']}-shot, n={r['n']}, model {r['model']}, {r['elapsed_s']:.1f} s)\n"
            f"  strict-match     (score): {pm(r['strict_match'], r['strict_match_stderr'])}\n"
            f"  flexible-extract        : {pm(r['flexible_extract'], r['flexible_extract_stderr'])}")


# ---- CLI ---------------------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--data", required=True, help="GSM8K JSONL: one {\"question\", \"answer\"} per line")
    p.add_argument("--num-fewshot", type=int, default=8)
    p.add_argument("--fewshot-data", default=None,
                   help="take the shots from the start of this JSONL (default: the start of --data)")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most N examples")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--out", default=None, help="write results and per-example samples here (JSON)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def cmd_gsm8k(args: argparse.Namespace) -> int:
    if args.num_fewshot < 0:
        raise KestrelError("--num-fewshot must be >= 0")
    for name in ("concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise KestrelError(f"--{name.replace('_', '-')} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise KestrelError("--limit must be >= 1")
    data = load_jsonl(args.data)
    few = load_jsonl(args.fewshot_data, "--fewshot-data") if args.fewshot_data else None
    shots, examples = split_examples(data, args.num_fewshot, few, args.limit)
    results, samples = asyncio.run(evaluate(args.url, examples, shots, args.concurrency, args.max_tokens,
                                            args.model, args.api_key, progress=not args.no_progress,
                                            timeout=args.timeout))
    print(format_results(results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"results": results, "samples": samples}, f, indent=1, ensure_ascii=False)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
