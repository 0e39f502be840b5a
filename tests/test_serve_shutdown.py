"""SIGTERM on a real `kestrel serve` with requests in flight: it stops accepting, lets what can finish within
--shutdown-timeout finish, answers the rest with a 503 (JSON, or an SSE error event and [DONE]), logs one line per
aborted request, no traceback, and exits 0."""

import json
import signal
import threading
import time

import httpx

import serve_helpers as H

GRACE = 1.5                 # the short stream (8 tokens) finishes inside it; 480 tokens take the tiny model
                            # over 3 s on an idle 2-core machine, so the long ones are still running at its end
LONG = {"prompt": "a very long story", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


def _stream(url: str, route: str, body: dict, out: dict, first: threading.Event) -> None:
    events = []
    with httpx.stream("POST", f"{url}{route}", json={**body, "stream": True}, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            choice = (json.loads(line[6:]).get("choices") or [{}])[0] if line.startswith("data: {") else {}
            if choice.get("text") or choice.get("delta", {}).get("content"):
                first.set()         # a first generated token: the request is running
    out["events"] = events


def _wait_running(url: str, n: int, within: float = 60.0) -> None:
    """Until the engine computes at least n requests (the metrics' running gauge): on a loaded machine a request
    sent last may not have reached the engine when the test moves on."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("kestrel_num_requests_running") and float(line.rsplit(" ", 1)[1]) >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} requests running after {within} s")


def _plain(url: str, body: dict, out: dict) -> None:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    out["status"], out["body"] = r.status_code, r.json()


def test_sigterm_with_in_flight_streams():
    srv = H.ServerProcess(H.model_dir(), "--shutdown-timeout", str(GRACE), api_key=None)
    try:
        results = {k: {} for k in ("stream", "chat", "plain", "short")}
        started = {k: threading.Event() for k in results}
        threads = [
            threading.Thread(target=_stream, args=(srv.url, "/v1/completions", LONG, results["stream"],
                                                   started["stream"])),
            threading.Thread(target=_stream, args=(srv.url, "/v1/chat/completions",
                                                   {**{k: v for k, v in LONG.items() if k != "prompt"},
                                                    "messages": [{"role": "user", "content": "talk"}]},
                                                   results["chat"], started["chat"])),
            threading.Thread(target=_plain, args=(srv.url, LONG, results["plain"])),
        ]
        for t in threads:
            t.start()
        assert started["stream"].wait(60) and started["chat"].wait(60)
        _wait_running(srv.url, 3)                  # the plain request too (it has no stream to show it started)
        # a short stream, in flight at the signal, that finishes within the grace period
        short = threading.Thread(target=_stream, args=(srv.url, "/v1/completions",
                                                       {**LONG, "max_tokens": 8}, results["short"], started["short"]))
        short.start()
        assert started["short"].wait(60)
        t_signal = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:                                       # no new connections once the signal arrived
            r = httpx.get(f"{srv.url}/health", timeout=5)
            refused = r.status_code == 503
        except httpx.TransportError:
            refused = True
        assert refused
        for t in [*threads, short]:
            t.join(60)
        rc = srv.proc.wait(30)
        took = time.monotonic() - t_signal
    finally:
        srv.stop()
    log = srv.log()
    assert rc == 0, log
    assert GRACE - 0.5 < took < GRACE + 15, took
    assert "Traceback" not in log, log
    assert log.count("shutdown: aborted") == 3, log

    for name in ("stream", "chat"):
        events = results[name]["events"]
        assert results[name]["status"] == 200 and events[-1] == "data: [DONE]", events[-3:]
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == "server_shutdown" and err["type"] == "server_error"
    assert results["plain"]["status"] == 503 and results["plain"]["body"]["error"]["code"] == "server_shutdown"
    short_events = results["short"]["events"]
    assert short_events[-1] == "data: [DONE]"
    last = json.loads(short_events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
