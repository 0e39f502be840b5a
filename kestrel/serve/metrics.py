"""Prometheus text exposition (format 0.0.4) for the server, without a client library.

Gauges are read from `Engine.stats()` at scrape time; counters and histograms are updated by the server as
requests finish. Latencies are measured in the server from the moment a request's body was parsed, so they include
tokenization and queueing.
"""

from __future__ import annotations

import bisect
import threading

PREFIX = "kestrel_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(d: dict[str, str]) -> str:
    if not d:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(d.items())) + "}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, v: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, v)] += 1
            self.sum += v
            self.count += 1

    def render(self, labels: dict) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            acc = 0
            for b, c in zip(self.buckets + (float("inf"),), self.counts):
                acc += c
                out.append(f"{self.name}_bucket{_labels({**labels, 'le': _fmt(b)})} {acc}")
            out.append(f"{self.name}_sum{_labels(labels)} {_fmt(self.sum)}")
            out.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return out


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None, initial: tuple[str, ...] = ()):
        self.name, self.help, self.label = PREFIX + name, help, label
        self.values: dict[str, float] = {k: 0 for k in initial} if label else {"": 0}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, label: str = "") -> None:
        with self._lock:
            self.values[label] = self.values.get(label, 0) + amount

    def get(self, label: str = "") -> float:
        return self.values.get(label, 0)

    def render(self, labels: dict) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            for k, v in sorted(self.values.items()):
                lab = {**labels, self.label: k} if self.label else labels
                out.append(f"{self.name}{_labels(lab)} {_fmt(v)}")
        return out


def _gauge(name: str, help: str, value: float, labels: dict) -> list[str]:
    n = PREFIX + name
    return [f"# HELP {n} {help}", f"# TYPE {n} gauge", f"{n}{_labels(labels)} {_fmt(value)}"]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request receipt to its first token.",
                              TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per finished request.", TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request receipt to its last token.",
                             E2E_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated (finished or aborted).")
        self.finished = Counter("request_success_total", "Engine requests finished, by finish reason.",
                                label="finish_reason", initial=("stop", "length", "abort"))
        self.http = Counter("http_responses_total", "HTTP responses of the API routes, by status code.",
                            label="code")
        self.in_flight = 0

    def observe_request(self, received: float, first_token: float | None, finished: float, prompt_tokens: int,
                        generated: int, finish_reason: str) -> None:
        """One engine request (one choice) ended; times are time.monotonic() values."""
        self.finished.inc(label=finish_reason or "abort")
        self.generation_tokens.inc(generated)
        if finish_reason == "abort":
            return
        self.prompt_tokens.inc(prompt_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - received)
            if generated > 1:
                self.tpot.observe((finished - first_token) / (generated - 1))
        self.e2e.observe(finished - received)

    def render(self, stats: dict, total_pages: int, total_slots: int) -> str:
        lab = self.labels
        lines: list[str] = []
        lines += _gauge("num_requests_running", "Engine requests being computed (holding cache).",
                        stats.get("running", 0), lab)
        lines += _gauge("num_requests_waiting", "Engine requests queued for admission.", stats.get("waiting", 0), lab)
        lines += _gauge("num_http_requests_in_flight", "Generation HTTP requests being answered.", self.in_flight,
                        lab)
        lines += _gauge("kv_cache_usage_perc", "Fraction of MLA KV cache pages in use (0..1).",
                        stats.get("cache_usage", 0.0), lab)
        lines += _gauge("kv_cache_used_pages", "MLA KV cache pages referenced by requests.",
                        stats.get("used_pages", 0), lab)
        lines += _gauge("kv_cache_total_pages", "MLA KV cache pages in the pool.", total_pages, lab)
        lines += _gauge("kda_state_used_slots", "KDA state slots held by requests.", stats.get("used_slots", 0), lab)
        lines += _gauge("kda_state_total_slots", "KDA state slots in the pool.", total_slots, lab)
        lines += _gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked "
                        "up, since start (0..1).", stats.get("prefix_hit_rate", 0.0), lab)
        for key, name, help in (("preemptions", "num_preemptions_total", "Requests preempted (recomputed later)."),
                                ("steps", "engine_steps_total", "Engine steps run."),
                                ("prefix_hit_tokens", "prefix_cache_hit_tokens_total",
                                 "Prompt tokens restored from the prefix cache.")):
            if key in stats:
                n = PREFIX + name
                lines += [f"# HELP {n} {help}", f"# TYPE {n} counter", f"{n}{_labels(lab)} {_fmt(stats[key])}"]
        if "spec" in stats:
            lines += spec_lines(stats["spec"], lab)
        for m in (self.prompt_tokens, self.generation_tokens, self.finished, self.http, self.ttft, self.tpot,
                  self.e2e):
            lines += m.render(lab)
        return "\n".join(lines) + "\n"


def spec_lines(spec: dict, lab: dict) -> list[str]:
    """Speculative decoding (Engine.stats()["spec"]): token counters, the acceptance-length histogram (tokens a
    verify block emitted, accepted drafts + 1) and the time split between proposing, verify steps and plain decode
    steps."""
    lines: list[str] = []
    for key, name, help in (("draft_tokens", "spec_draft_tokens_total", "Draft tokens verified."),
                            ("accepted_tokens", "spec_accepted_tokens_total", "Draft tokens accepted."),
                            ("verify_blocks", "spec_verify_blocks_total", "Verify blocks (one per speculating "
                             "request and step)."),
                            ("verify_steps", "spec_verify_steps_total", "Engine steps that verified blocks."),
                            ("draft_s", "spec_draft_seconds_total", "Seconds spent proposing drafts."),
                            ("verify_s", "spec_verify_seconds_total", "Seconds of steps that verified blocks."),
                            ("decode_s", "spec_decode_seconds_total", "Seconds of plain decode steps (no verify).")):
        n = PREFIX + name
        lines += [f"# HELP {n} {help}", f"# TYPE {n} counter", f"{n}{_labels(lab)} {_fmt(spec.get(key, 0))}"]
    lines += _gauge("spec_accepted_tokens_per_step", "Draft tokens accepted per verify step, since start.",
                    spec.get("accepted_per_step", 0.0), lab)
    n = PREFIX + "spec_acceptance_length"
    hist = {int(k): v for k, v in spec.get("accept_len_hist", {}).items()}
    lines += [f"# HELP {n} Tokens emitted per verify block (accepted drafts + 1).", f"# TYPE {n} histogram"]
    acc = 0
    for length in sorted(hist):
        acc += hist[length]
        lines.append(f"{n}_bucket{_labels({**lab, 'le': str(length)})} {acc}")
    lines.append(f"{n}_bucket{_labels({**lab, 'le': '+Inf'})} {acc}")
    lines.append(f"{n}_sum{_labels(lab)} {_fmt(sum(k * v for k, v in hist.items()))}")
    lines.append(f"{n}_count{_labels(lab)} {acc}")
    return lines


def parse_prometheus(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` of a Prometheus text page (tests and the load generator read /metrics with it)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out


def metric(values: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of one series of a parsed page; labels given must match, others are ignored."""
    for key, v in values.items():
        base, _, rest = key.partition("{")
        if base != name and base != PREFIX + name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            return v
    return None
