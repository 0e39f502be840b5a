"""Disaggregated serving end to end on loopback: real `kestrel serve` processes (3 context, 2 generation, 2
frontends sharing one discovery directory, one aggregated server), a tiny model made by the test.

Outputs through the frontends equal the aggregated server's token for token (greedy and seeded sampling, prefix
hits on the context servers, completions and chat, streaming and not), 100 concurrent streams, a flipped byte in a
transfer (retried, then failed), a layout mismatch at the handshake, a generation server killed mid-stream (the
stream ends with a clear error), context servers killed in the middle of a request, once before they answer and
once after, with the state in their memory (the request runs again on another context server, its output still
the aggregated one), the survivors' pages and slots all back and the frontend serving on, and a scan of every
server log. The generation servers pull over ZMQ (one) and NIXL where it imports (the other).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

import serve_helpers as H
from log_scan import assert_clean

AUTH = {"Authorization": f"Bearer {H.API_KEY}"}
COMMON = ["--page-size", "16", "--handoff-timeout", "60", "--max-num-seqs", "64"]

# lines a survivor may log when a peer is killed or a transfer is corrupted on purpose (log_scan.py)
ALLOW = (
    "kestrel.disagg: generation server {*} did not answer ({*}); skipping it until its next heartbeat",
    "kestrel.disagg: context server {*} did not answer ({*}); skipping it until its next heartbeat",
    "kestrel.disagg: handoff {*} from {*}: the transferred state fails its checksum ({*} != {*}): bytes were "
    "corrupted on the way (attempt {*} of 2)",
)


class Proc:
    """One `kestrel serve` process; started without waiting, so that all of them load at once."""

    def __init__(self, name: str, *args: str, directory: str):
        self.name = name
        self.log_path = os.path.join(directory, f"{name}.log")
        env = dict(os.environ, OMP_NUM_THREADS="1", KESTREL_DISAGG_FAULTS="1",
                   PYTHONPATH=H.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--model", H.model_dir(), "--port", "0",
               "--no-access-log", "--max-model-len", str(H.MAX_MODEL_LEN), "--api-key", H.API_KEY, *args]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=H.REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = None

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            m = re.search(r"serving \S+ at (http://[^\s/]+)/v1", self.log())
            if m and (self.name[0] not in "cg" or "published in" in self.log()):
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@pytest.fixture(scope="module")
def cluster():
    H.model_dir()
    tmp = tempfile.mkdtemp(prefix="kestrel-disagg-")
    disc = os.path.join(tmp, "discovery")
    d = ["--discovery-dir", disc]
    procs = {
        "agg": Proc("agg", *COMMON, directory=tmp),
        "c1": Proc("c1", "--role", "context", *d, *COMMON, directory=tmp),
        "c2": Proc("c2", "--role", "context", *d, *COMMON, directory=tmp),
        "c3": Proc("c3", "--role", "context", *d, *COMMON, directory=tmp),
        "g1": Proc("g1", "--role", "generation", *d, "--kv-transport", "zmq", *COMMON, directory=tmp),
        "g2": Proc("g2", "--role", "generation", *d, "--kv-transport", "auto", *COMMON, directory=tmp),
    }
    try:
        deadline = time.monotonic() + 240
        for p in procs.values():
            p.wait_ready(deadline)
        # frontends after the servers' files exist; f1 first, so it is the clock seed
        procs["f1"] = Proc("f1", "--role", "frontend", *d, directory=tmp)
        procs["f1"].wait_ready(deadline)
        procs["f2"] = Proc("f2", "--role", "frontend", *d, directory=tmp)
        procs["f2"].wait_ready(deadline)
        for f in ("f1", "f2"):
            _until(lambda: httpx.get(f"{procs[f].url}/health").json()["generation"] == 2, 30)
        yield procs
    finally:
        for p in procs.values():        # all at once: each gets its SIGTERM before anyone waits
            if p.proc.poll() is None:
                p.proc.terminate()
        for p in procs.values():
            p.stop()


def _until(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


def _post(url: str, route: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={**AUTH, **(headers or {})}, timeout=120)


def _stream_ids(url: str, route: str, body: dict) -> tuple[list[int], str, list[dict]]:
    ids, text, events = [], "", []
    with httpx.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True, "return_token_ids": True},
                      headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            for ch in ev.get("choices", []):
                ids += ch.get("token_ids", [])
                text += ch.get("text", "") or (ch.get("delta") or {}).get("content", "") or ""
    return ids, text, events


PROMPTS = ["The kestrel hovers over the field", "a b c d e f g h i j k l m n o p q r s t"]
PARAMS = [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 7},
          {"temperature": 1.0, "top_k": 20, "seed": 3}]


def test_outputs_equal_aggregated(cluster):
    agg, f1, f2 = cluster["agg"].url, cluster["f1"].url, cluster["f2"].url
    for i, prompt in enumerate(PROMPTS):
        for j, params in enumerate(PARAMS):
            body = {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "return_token_ids": True, **params}
            want = _post(agg, "completions", body).json()["choices"][0]
            got = _post(f1 if (i + j) % 2 else f2, "completions", body).json()["choices"][0]
            assert (got["token_ids"], got["text"]) == (want["token_ids"], want["text"]), (prompt, params)
            if i == 0:
                ids, text, _ = _stream_ids(f1, "completions", body)
                assert (ids, text) == (want["token_ids"], want["text"])
    chat = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8, "temperature": 0.7,
            "seed": 5, "ignore_eos": True}
    want = _post(agg, "chat/completions", chat).json()["choices"][0]["message"]["content"]
    assert _post(f1, "chat/completions", chat).json()["choices"][0]["message"]["content"] == want
    assert _stream_ids(f2, "chat/completions", chat)[1] == want
    # n > 1: one state per choice
    many = {"prompt": PROMPTS[0], "max_tokens": 6, "n": 3, "temperature": 0.9, "seed": 1, "ignore_eos": True,
            "return_token_ids": True}
    assert [c["token_ids"] for c in _post(f1, "completions", many).json()["choices"]] == \
        [c["token_ids"] for c in _post(agg, "completions", many).json()["choices"]]


def test_prefix_hits_on_the_context_servers(cluster):
    agg, f1 = cluster["agg"].url, cluster["f1"].url
    body = {"prompt": "The long shared system prompt of many requests, " * 4, "max_tokens": 6,
            "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
    want = _post(agg, "completions", body).json()["choices"][0]["token_ids"]
    cached = []
    for _ in range(4):              # round robin over 3 context servers: the 4th request meets the prompt again
        r = _post(f1, "completions", body).json()
        assert r["choices"][0]["token_ids"] == want
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert max(cached) >= 32 and cached[0] == 0, cached
    recs = httpx.get(f"{f1}/disagg/timings", headers=AUTH).json()[-4:]
    assert max(r["cached_tokens"] for r in recs) >= 32


def test_100_concurrent_streams(cluster):
    agg, fronts = cluster["agg"].url, [cluster["f1"].url, cluster["f2"].url]

    async def one(client, url, i):
        body = {"prompt": f"request number {i} says " + "xyz"[i % 3] * (i % 7 + 1), "max_tokens": 3,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        ids, done = [], False
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    ids += ev["choices"][0].get("token_ids", [])
        assert done
        return ids

    async def main():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            got = await asyncio.gather(*(one(client, fronts[i % 2], i) for i in range(100)))
            want = await asyncio.gather(*(one(client, agg, i) for i in range(100)))
        return got, want

    got, want = asyncio.run(main())
    assert got == want and all(len(g) == 3 for g in got)


def test_clock_offsets_and_ttft_split(cluster):
    f1, f2 = cluster["f1"].url, cluster["f2"].url
    servers = {cluster[k].url for k in ("c1", "c2", "c3", "g1", "g2")}
    o1 = httpx.get(f"{f1}/disagg/clock-offsets", headers=AUTH).json()
    o2 = httpx.get(f"{f2}/disagg/clock-offsets", headers=AUTH).json()     # forwarded to the seed
    assert set(o1) == servers and o1 == o2
    assert all(abs(o["offset"]) < 1e5 and 0 <= o["rtt"] < 1.0 for o in o1.values())
    assert httpx.get(f"{f2}/disagg/servers", headers=AUTH).json()["seed"] is False
    _post(f2, "completions", {"prompt": "timing", "max_tokens": 2})
    for f in (f1, f2):
        rec = httpx.get(f"{f}/disagg/timings", headers=AUTH).json()[-1]
        parts = [rec[k] for k in ("route", "queue", "prefill", "transfer", "first_decode")]
        assert all(p is not None and p >= 0 for p in parts), rec
        # the parts are taken on three clocks mapped onto one: they add up to the TTFT within the offsets' error
        assert abs(sum(parts) - rec["ttft"]) < 0.05 + rec["ttft"] * 0.2, rec
        assert rec["nbytes"] > 0 and rec["transport"] in ("zmq", "nixl")


def test_corrupted_transfer_is_retried_then_fails(cluster):
    agg, f1 = cluster["agg"].url, cluster["f1"].url
    body = {"prompt": "checksums matter", "max_tokens": 5, "temperature": 0.0, "return_token_ids": True}
    want = _post(agg, "completions", body).json()["choices"][0]["token_ids"]
    once = _post(f1, "completions", body, {"x-kestrel-fault": "flip=1"})
    assert once.status_code == 200 and once.json()["choices"][0]["token_ids"] == want
    twice = _post(f1, "completions", body, {"x-kestrel-fault": "flip=2"})
    err = H.assert_error_shape(twice, 502, None)
    assert "failed its checksum twice" in err["message"] and err["code"] == "kv_transfer_failed"
    # the servers' warnings reach their log files a moment after the response may (another process's output)
    deadline = time.monotonic() + 10.0
    while True:
        warned = cluster["g1"].log() + cluster["g2"].log()
        if warned.count("fails its checksum") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert warned.count("fails its checksum") >= 3
    _no_leaks(cluster, ("c1", "c2", "c3", "g1", "g2"))


def test_layout_mismatch_refused_at_the_handshake(cluster):
    """A generation server asked to pull from a context transport whose layout differs answers 409 naming the
    first difference, and pulls nothing."""
    from kestrel.disagg.transport import StateServer, StateStore
    g1 = cluster["g1"].url
    status = httpx.get(f"{g1}/disagg/status", headers=AUTH).json()
    theirs = httpx.get(f"{cluster['f1'].url}/disagg/servers", headers=AUTH).json()
    layout = next(s["cache_layout"] for s in theirs["servers"] if s["url"] == g1)
    other = {**layout, "page_size": 32}
    srv = StateServer(StateStore(), other).start()
    try:
        head = {"x-kestrel-handoff": json.dumps({"transport": {"zmq": srv.address, "nixl": False},
                                                 "transfers": [{"tid": "x", "prompt": "", "seed": 1}]})}
        r = httpx.post(f"{g1}/disagg/generate/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={**AUTH, **head}, timeout=30)
    finally:
        srv.stop()
    err = H.assert_error_shape(r, 409, None)
    assert "page_size: context has 32, generation has 16" in err["message"]
    assert httpx.get(f"{g1}/disagg/status", headers=AUTH).json()["used_pages"] == status["used_pages"] == 0


def _status(cluster, name):
    return httpx.get(f"{cluster[name].url}/disagg/status", headers=AUTH, timeout=10).json()


def _no_leaks(cluster, names):
    for n in names:
        _until(lambda: (lambda s: s["used_pages"] == s["used_slots"] == s["held_states"] == s["running"] == 0)(
            _status(cluster, n)), 15)
        s = _status(cluster, n)
        assert s["free_slots"] == s["num_slots"] and s["free_pages"] == s["num_pages"], (n, s)


def test_killed_generation_server_mid_stream(cluster):
    f1 = cluster["f1"].url
    body = {"prompt": "a long answer please", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
            "stream": True}
    events = []
    with httpx.stream("POST", f"{f1}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                break
        rec = httpx.get(f"{f1}/disagg/timings", headers=AUTH).json()[-1]
        victim = next(k for k in ("g1", "g2") if cluster[k].url == rec["generation"])
        cluster[victim].kill()
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][6:])["error"]
    assert "went away mid-stream" in err["message"] and err["code"] == "generation_server_lost"
    survivor = "g2" if victim == "g1" else "g1"
    for _ in range(4):              # the frontend keeps serving, on the survivor
        r = _post(f1, "completions", {"prompt": "still here?", "max_tokens": 3})
        assert r.status_code == 200, r.text
    _no_leaks(cluster, ("c1", "c2", "c3", survivor))


def _alive(cluster, names):
    return [k for k in names if cluster[k].proc.poll() is None]


def _kill_context_server_mid_request(cluster, fault: str, stream: bool):
    """A request whose first context server is killed (`fault`, worker.py) succeeds through another, its tokens
    those of the aggregated server; returns the killed server's name."""
    agg, f1 = cluster["agg"].url, cluster["f1"].url
    before = _alive(cluster, ("c1", "c2", "c3"))
    body = {"prompt": f"the context server dies {fault}", "max_tokens": 6, "temperature": 0.8, "seed": 9,
            "ignore_eos": True, "return_token_ids": True}
    want = _post(agg, "completions", body).json()["choices"][0]["token_ids"]
    if stream:
        ids = []
        with httpx.stream("POST", f"{f1}/v1/completions", json={**body, "stream": True}, timeout=120,
                          headers={**AUTH, "x-kestrel-fault": fault}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    ids += ev["choices"][0].get("token_ids", []) if ev["choices"] else []
    else:
        r = _post(f1, "completions", body, {"x-kestrel-fault": fault})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["token_ids"]
    assert ids == want
    _until(lambda: len(_alive(cluster, before)) == len(before) - 1, 15)
    (victim,) = set(before) - set(_alive(cluster, before))
    assert f"request retried from its prompt on context server" in cluster["f1"].log()
    return victim


def test_context_server_killed_after_prefill_is_retried(cluster):
    """The context server answers the prefill and dies with the state in its memory: the generation server's pull
    finds no one (502 context_state_lost to the frontend), and the frontend runs the prompt again on another
    context server."""
    victim = _kill_context_server_mid_request(cluster, "kill=after-prefill", stream=False)
    front = cluster["f1"].log()
    assert f"context server {cluster[victim].url} did not answer (its-state-never-arrived)" in front
    assert "did not arrive from the context server" in front and "may have died" in front
    _no_leaks(cluster, _alive(cluster, ("c1", "c2", "c3", "g1", "g2")))


def test_context_server_killed_mid_prefill_is_retried(cluster):
    """The context server dies after running the prompt, before it answers (the frontend's connection resets):
    the streamed request runs on another context server; afterwards the frontend serves on with the survivors."""
    victim = _kill_context_server_mid_request(cluster, "kill=in-prefill", stream=True)
    assert f"context server {cluster[victim].url} did not answer (RemoteProtocolError)" in cluster["f1"].log()
    for f in ("f1", "f2", "f1", "f2"):       # f2 has not seen the deaths yet: it skips the dead servers too
        r = _post(cluster[f].url, "completions", {"prompt": "after the context servers died", "max_tokens": 3})
        assert r.status_code == 200, r.text
    _no_leaks(cluster, _alive(cluster, ("c1", "c2", "c3", "g1", "g2")))


def test_server_logs_are_clean(cluster):
    assert_clean({name: p.log() for name, p in cluster.items() if isinstance(p, Proc)}, ALLOW)
