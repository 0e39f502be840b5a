"""Disaggregated serving, in one process: the request-state handoff between two engines (draft layers included),
the checksum, the layout handshake, discovery files, clock offsets, both transports and the log scan."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import torch

import serve_helpers as H
from log_scan import offending_lines
from kestrel.disagg import clocks
from kestrel.disagg.discovery import Entry, Publisher, read_entries, write_atomic
from kestrel.disagg.handshake import LayoutMismatch, cache_layout, check_match, first_difference
from kestrel.disagg import transport
from kestrel.disagg.transport import (StateClient, StateServer, StateStore, TransportError, join_frames, nixl_api,
                                      split_frames)
from kestrel.runtime.handoff import (HandoffError, PackedState, admit_imported, checksum, export_state,
                                     pool_entries, verify)
from kestrel.sampling_params import SamplingParams

DRAFT = 90          # a drafter's appended MLA layer id (kestrel/spec/proposer.py `extra_layers`)


def _engine(**kw):
    from kestrel.llm import build_engine
    from kestrel.config import EngineConfig
    return build_engine(EngineConfig(model=H.model_dir(), max_model_len=H.MAX_MODEL_LEN, page_size=16,
                                     kv_cache_tokens=2048, max_num_seqs=8, **kw))


@pytest.fixture(scope="module")
def engines():
    with H.single_thread():
        ctx, gen, agg = _engine(), _engine(), _engine()
    for e in (ctx, gen):
        e.cache.add_layers({DRAFT: "mla"})
    return ctx, gen, agg


def _run(engine, ids, params, rid, on_add=None):
    engine.add_request(ids, params, rid)
    req = engine.requests[rid]
    outs = on_add(engine, req) if on_add else []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    final = outs[-1]
    engine.release(rid)
    return list(final.token_ids), final.text


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.0),
                                    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11)])
def test_handoff_between_engines_equals_aggregated(engines, params):
    """Context engine: prompt + first token, state exported (the draft layer's pages too); generation engine:
    imported into fresh pages and slot, decoded on; the tokens equal one aggregated engine's, and the draft
    layer's bytes arrive unchanged. A second request with the same prompt is a prefix hit on the context engine."""
    ctx, gen, agg = engines
    ids = list(range(3, 45))            # 42 tokens: two full pages of 16 and a partial one
    with H.single_thread():
        want, want_text = _run(agg, ids, params, "agg")
        for rep in range(2):
            box = {}

            def handoff(req):
                pages = torch.tensor(req.pages)
                ctx.cache.pools.mla[DRAFT][pages] = torch.randn_like(ctx.cache.pools.mla[DRAFT][pages])
                box["draft"] = ctx.cache.pools.mla[DRAFT][pages].clone()
                box["state"] = export_state(ctx.cache.pools, req, len(req.prompt_token_ids))
                box["first"], box["seed"] = req.output_token_ids[0], req.seed

            def hook(engine, req):
                req.handoff = handoff
                return []

            p1 = SamplingParams(**{**params.__dict__, "max_tokens": 1})
            first, _ = _run(ctx, ids, p1, f"ctx-{rep}", hook)
            if rep == 1:
                assert ctx.cache.hit_tokens > 0          # the second prompt restored pages + snapshot
            assert ctx.cache.used_pages == 0 and ctx.cache.used_slots == 0
            state = box["state"]
            assert {(p, l) for p, l, *_ in state.manifest["entries"]} == set(pool_entries(gen.cache.pools))
            assert ("mla", DRAFT) in {(p, l) for p, l, *_ in state.manifest["entries"]}
            wire = PackedState(state.manifest, state.buffer.clone(), state.checksum)
            verify(wire)
            gp = SamplingParams(**{**params.__dict__, "seed": box["seed"]})
            seen = {}

            def admit(engine, req):
                outs = admit_imported(engine, req, wire, box["first"])
                seen["draft"] = engine.cache.pools.mla[DRAFT][torch.tensor(req.pages[:3])].clone()
                return outs

            got, text = _run(gen, ids, gp, f"gen-{rep}", admit)
            assert got == want and text == want_text and first == want[:1]
            assert torch.equal(seen["draft"], box["draft"])
            assert gen.cache.used_pages == 0 and gen.cache.used_slots == 0


def test_handoff_with_dspark_speculation_equals_aggregated(tmp_path):
    """DSpark speculation on every engine: the context engine's prefill writes the drafter's context KV (observe),
    which travels with the state; the generation engine verifies blocks from the first step after import. Greedy
    tokens equal an aggregated speculating engine's and a plain one's, the drafter's pages arrive unchanged, and
    the generation engine really speculated."""
    from kestrel.config import ModelConfig
    from kestrel.spec.dspark_checkpoint import write_random_drafter
    from kestrel.spec.dspark_config import tiny_config
    config = ModelConfig.from_dir(H.model_dir())
    drafter = write_random_drafter(str(tmp_path / "drafter"), tiny_config(config, block_size=3), config, seed=5)
    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": 3, "enforce": True}
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ids = list(range(7, 44))
    with H.single_thread():
        ctx, gen, agg = (_engine(speculative_config=spec) for _ in range(3))
        want, _ = _run(agg, ids, params, "agg")
        plain, _ = _run(_engine(), ids, params, "plain")
        draft_layers = sorted(ctx.proposer.extra_layers)
        assert draft_layers and set(draft_layers) <= set(ctx.cache.pools.mla)
        box = {}

        def handoff(req):
            pages = torch.tensor(req.pages)
            box["draft"] = {i: ctx.cache.pools.mla[i][pages].clone() for i in draft_layers}
            box["state"] = export_state(ctx.cache.pools, req, len(req.prompt_token_ids))
            box["first"], box["seed"] = req.output_token_ids[0], req.seed

        def hook(engine, req):
            req.handoff = handoff
            return []

        _run(ctx, ids, SamplingParams(max_tokens=1, temperature=0.0), "ctx", hook)
        assert any(box["draft"][i].abs().sum() > 0 for i in draft_layers)     # observe wrote the context KV
        wire = PackedState(box["state"].manifest, box["state"].buffer.clone(), box["state"].checksum)
        verify(wire)
        seen = {}

        def admit(engine, req):
            outs = admit_imported(engine, req, wire, box["first"])
            pages = torch.tensor(req.pages[:len(box["draft"][draft_layers[0]])])
            seen["draft"] = {i: engine.cache.pools.mla[i][pages].clone() for i in draft_layers}
            return outs

        got, _ = _run(gen, ids, SamplingParams(max_tokens=10, temperature=0.0, seed=box["seed"]), "gen", admit)
    assert got == want == plain
    assert all(torch.equal(seen["draft"][i], box["draft"][i]) for i in draft_layers)
    assert gen.stats()["spec"]["verify_blocks"] > 0
    assert gen.cache.used_pages == 0 and gen.cache.used_slots == 0


@pytest.mark.parametrize("algo", ["xxh128", "crc32", "wsum"])
def test_checksum_catches_every_single_byte_flip(algo):
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=g)     # not a multiple of 4
    man = {"entries": [["mla", 2, "float32", [1], 0, 4099]]}
    base = checksum(buf, man, algo)
    assert base.startswith(algo + ":") and checksum(buf.clone(), man, algo) == base
    for pos in torch.randint(0, buf.numel(), (64,), generator=g).tolist():
        for bit in (0, 3, 7):
            b = buf.clone()
            b[pos] ^= 1 << bit
            assert checksum(b, man, algo) != base
    assert checksum(buf, {**man, "num_tokens": 3}, algo) != base
    verify(PackedState(man, buf.clone(), base))
    with pytest.raises(HandoffError, match="checksum"):
        verify(PackedState(man, torch.cat([buf[:-1], buf[-1:] ^ 1]), base))


def test_host_checksum_is_xxh128_and_names_a_missing_xxhash(monkeypatch):
    import kestrel.runtime.handoff as handoff
    buf = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    man = {"entries": []}
    assert checksum(buf, man).startswith("xxh128:")
    swapped = torch.cat([buf[500:], buf[:500]])            # same bytes, other order: a position-blind sum would pass
    assert checksum(swapped, man) != checksum(buf, man)
    monkeypatch.setattr(handoff, "xxhash", None)
    with pytest.raises(HandoffError, match="pip install xxhash"):
        checksum(buf, man, "xxh128")


def test_pool_entries_refuse_an_unknown_pool():
    from dataclasses import dataclass, field
    from kestrel.models.kimi.step import CachePools

    @dataclass
    class MorePools(CachePools):
        scales: dict = field(default_factory=dict)

    with pytest.raises(HandoffError, match="scales"):
        pool_entries(MorePools(page_size=4))


def _layout(**edits):
    base = {"page_size": 16, "mla_layers": [2, 5], "kv_dtypes": {2: "bfloat16", 5: "bfloat16"},
            "mla_width": {2: 40, 5: 40}, "kda_layers": [0, 1], "kda_state_dtypes": {0: ["bfloat16", "float32"],
                                                                                     1: ["bfloat16", "float32"]},
            "kda_state_shapes": {0: [[192, 3], [4, 16, 16]], 1: [[192, 3], [4, 16, 16]]},
            "parallel": {"tp": 1, "dp": 1, "ep": 1, "cp": 1}}
    for k, v in edits.items():
        base[k] = v
    return base


@pytest.mark.parametrize("edit, named", [
    ({"page_size": 32}, "page_size: context has 16, generation has 32"),
    ({"kv_dtypes": {2: "bfloat16", 5: "float8_e4m3fn"}}, "kv_dtypes[5]: context has bfloat16, generation has "
                                                         "float8_e4m3fn"),
    ({"mla_layers": [2, 5, 90]}, "layer 90 only on the generation side"),
    ({"kda_state_dtypes": {0: ["bfloat16", "float32"], 1: ["bfloat16", "bfloat16"]}}, "kda_state_dtypes[1]"),
    ({"parallel": {"tp": 2, "dp": 1, "ep": 1, "cp": 1}}, "parallel[tp]: context has 1, generation has 2"),
])
def test_handshake_names_the_first_difference(edit, named):
    a, b = _layout(), _layout(**edit)
    assert first_difference(a, a) is None
    assert named in first_difference(a, b)
    with pytest.raises(LayoutMismatch, match="cache layouts differ"):
        check_match(a, b)
    # through YAML / JSON the int keys become strings: still equal
    import json
    assert first_difference(a, json.loads(json.dumps(a))) is None


def test_handshake_orders_fields():
    """Several differences: the page size is named before a layer dtype."""
    b = _layout(page_size=8, kv_dtypes={2: "float32", 5: "float32"})
    assert first_difference(_layout(), b).startswith("page_size")


def test_cache_layout_lists_extra_layers(engines):
    ctx, _, agg = engines
    lay = cache_layout(ctx.cache, ctx.config)
    assert DRAFT in lay["mla_layers"] and lay["kv_dtypes"][DRAFT] == "fp32"     # the page format (kestrel/quant/kv_cache.py)
    assert "layer 90 only on the context side" in first_difference(lay, cache_layout(agg.cache, agg.config))


def test_discovery_atomic_entries_and_stale_drop():
    d = tempfile.mkdtemp(prefix="kestrel-disc-")
    pub = Publisher(d, Entry(url="http://127.0.0.1:1234", role="context", model="tiny",
                             cache_layout=_layout()), interval=0.05).start()
    try:
        time.sleep(0.2)
        got = read_entries(d, stale_after=1.0)
        assert [(e.url, e.role) for e in got] == [("http://127.0.0.1:1234", "context")]
        assert isinstance(got[0].url, str) and first_difference(got[0].cache_layout, _layout()) is None
        assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
        stale = os.path.join(d, "generation-old.yaml")
        write_atomic(stale, {"url": "http://127.0.0.1:9", "role": "generation", "model": "tiny",
                             "heartbeat": time.time() - 30})
        write_atomic(os.path.join(d, "ancient.yaml"), {"url": "http://x:1", "role": "context",
                                                       "heartbeat": time.time() - 120})
        with open(os.path.join(d, "junk.yaml"), "w") as f:
            f.write("{not yaml")
        assert [e.role for e in read_entries(d, stale_after=1.0)] == ["context"]
        assert os.path.exists(stale) and not os.path.exists(os.path.join(d, "ancient.yaml"))
    finally:
        pub.stop()
    assert read_entries(d) == []


def test_clock_offset_estimate_prefers_the_shortest_round_trip():
    o = clocks.estimate([(0.0, 105.0, 4.0), (10.0, 110.6, 10.2), (20.0, 121.0, 21.0)])
    assert o.rtt == pytest.approx(0.2) and o.offset == pytest.approx(110.6 - 10.1)
    assert clocks.to_local(200.0, o) == pytest.approx(200.0 - o.offset)
    s = clocks.ttft_split({"arrival": 101.0, "first_scheduled": 101.5, "first_token": 102.0}, {"verified": 53.0},
                          100.0, 50.0, 0.5, 3.5)
    assert s == pytest.approx({"route": 0.5, "queue": 0.5, "prefill": 0.5, "transfer": 1.0, "first_decode": 0.5,
                               "ttft": 3.0})
    # the finer timestamps split route (HTTP, then parsing and the engine's lock) and transfer
    s = clocks.ttft_split({"received": 100.7, "arrival": 101.0, "first_scheduled": 101.5, "first_token": 102.0,
                           "exported": 102.1, "answered": 102.2},
                          {"received": 52.5, "verified": 53.0, "pull_s": 0.2, "verify_s": 0.05}, 100.0, 50.0, 0.5, 3.5)
    assert s == pytest.approx({"route": 0.5, "queue": 0.5, "prefill": 0.5, "transfer": 1.0, "first_decode": 0.5,
                               "ttft": 3.0, "route_http": 0.2, "admit": 0.3, "export": 0.1, "relay": 0.3,
                               "pull": 0.2, "verify": 0.05})


def _state(n=10000, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    man = {"num_tokens": 5, "page_size": 16, "num_pages": 1, "entries": [["mla", 2, "uint8", [n], 0, n]]}
    return PackedState(man, buf, checksum(buf, man))


@pytest.mark.parametrize("method", ["zmq", "nixl"])
def test_transport_round_trip_ack_and_handshake(method):
    if method == "nixl" and nixl_api() is None:
        pytest.skip("nixl does not import here (pip install nixl)")
    store = StateStore(hold=30)
    srv = StateServer(store, _layout()).start()
    try:
        st = _state()
        store.put("t1", st)
        cl = StateClient(timeout=5)
        cl.handshake(srv.address, _layout())
        got = cl.pull(srv.address, "t1", method)
        verify(got)
        assert torch.equal(got.buffer, st.buffer)
        cl.ack(srv.address, "t1")
        assert len(store) == 0
        with pytest.raises(TransportError, match="no exported state t1"):
            cl.pull(srv.address, "t1", method)
        with pytest.raises(LayoutMismatch, match="page_size: context has 16, generation has 64"):
            StateClient(timeout=5).handshake(srv.address, _layout(page_size=64))
    finally:
        srv.stop()


def test_transport_multi_frame_pull(monkeypatch):
    """A state larger than a frame travels as several frames (the last one shorter) and arrives byte for byte."""
    monkeypatch.setattr(transport, "FRAME_BYTES", 1000)
    store = StateStore(hold=30)
    srv = StateServer(store, _layout()).start()
    try:
        st = _state(n=10_007, seed=4)
        store.put("m", st)
        assert [len(f) for f in split_frames(st.buffer)] == [1000] * 10 + [7]
        got = StateClient(timeout=5).pull(srv.address, "m", "zmq")
        verify(got)
        assert torch.equal(got.buffer, st.buffer) and got.buffer.data_ptr() != st.buffer.data_ptr()
        if torch.cuda.is_available():       # a generation server whose pools are on a GPU: pinned staging
            pinned = StateClient(timeout=5, pin_memory=True).pull(srv.address, "m", "zmq")
            assert pinned.buffer.is_pinned() and torch.equal(pinned.buffer, st.buffer)
    finally:
        srv.stop()


def test_transport_keeps_its_connection_and_still_tells_a_dead_peer_at_once():
    """Calls from one thread reuse one connected socket; once the peer is gone the next call fails at once with
    the not-listening error (not after the timeout), and a call that failed leaves no socket behind."""
    store = StateStore(hold=30)
    srv = StateServer(store, _layout()).start()
    cl = StateClient(timeout=20)
    try:
        store.put("a", _state(seed=6))
        store.put("b", _state(seed=7))
        verify(cl.pull(srv.address, "a", "zmq"))
        sock = cl._local.socks[srv.address]
        verify(cl.pull(srv.address, "b", "zmq"))
        assert cl._local.socks[srv.address] is sock
        with pytest.raises(TransportError, match="no exported state zz"):     # a refusal keeps the socket
            cl.pull(srv.address, "zz", "zmq")
    finally:
        srv.stop()
    t0 = time.monotonic()
    _until = t0 + 5
    while cl._local.socks[srv.address].poll(0, 2) and time.monotonic() < _until:   # zmq.POLLOUT: ZMQ notices
        time.sleep(0.01)
    with pytest.raises(TransportError, match="not listening.*may have died"):
        cl.pull(srv.address, "a", "zmq")
    assert time.monotonic() - t0 < 5 and srv.address not in cl._local.socks


def test_frames_lost_cut_or_reordered_are_refused():
    """join_frames refuses a frame missing, one too many or a cut one (count and sizes against the header);
    frames of one size swapped, or a flipped byte inside a frame, join but fail the checksum: never imported."""
    st = _state(n=4000, seed=5)
    frames = split_frames(st.buffer, 1000)
    reply = {"nbytes": st.nbytes, "frames": [len(f) for f in frames]}
    assert torch.equal(join_frames(reply, frames, "t"), st.buffer)
    for bad in (frames[:3], frames[1:], frames + frames[:1], frames[:3] + [frames[3][:999]]):
        with pytest.raises(TransportError, match="frames were lost or cut"):
            join_frames(reply, bad, "t")
    with pytest.raises(TransportError, match="malformed"):
        join_frames({"nbytes": st.nbytes, "frames": [1000]}, frames[:1], "t")
    swapped = join_frames(reply, [frames[1], frames[0], *frames[2:]], "t")
    with pytest.raises(HandoffError, match="fails its checksum"):
        verify(PackedState(st.manifest, swapped, st.checksum))
    flipped = bytearray(frames[2])
    flipped[123] ^= 0x01
    joined = join_frames(reply, [*frames[:2], memoryview(flipped), frames[3]], "t")
    with pytest.raises(HandoffError, match="fails its checksum"):
        verify(PackedState(st.manifest, joined, st.checksum))


def test_transport_times_out_on_a_dead_peer_and_store_expires():
    cl = StateClient(timeout=0.3)
    with pytest.raises(TransportError, match="not listening.*may have died"):
        cl.pull("tcp://127.0.0.1:9", "t", "zmq")
    mute = H.free_socket()          # accepts connections but never answers: the timeout
    try:
        with pytest.raises(TransportError, match="did not answer pull within 0.3 s"):
            cl.pull(f"tcp://127.0.0.1:{mute.getsockname()[1]}", "t", "zmq")
    finally:
        mute.close()
    store = StateStore(hold=0.05)
    store.put("x", _state(16))
    time.sleep(0.1)
    assert store.get("x") is None and len(store) == 0


def test_log_scan_allow_list_is_exact():
    allow = ("kestrel.disagg: generation server {*} did not answer ({*}); skipping it until its next heartbeat",
             "WARNING known benign ERROR-free line")
    text = "\n".join([
        "2026-12-01 10:00:00,123 kestrel.serve: serving tiny",
        "kestrel.disagg: generation server http://127.0.0.1:5 did not answer (ReadError:); skipping it until "
        "its next heartbeat",
        "INFO:     all good",
    ])
    assert offending_lines(text, allow) == []
    bad = ["ERROR:    Exception in ASGI application",
           "Traceback (most recent call last):",
           "kestrel.disagg: generation server http://x:5 did not answer (Traceback); skipping it until its next "
           "heartbeat",
           "kestrel.disagg: generation server http://x:5 did not answer (ReadError:); skipping it until its next "
           "heartbeat ERROR"]
    assert offending_lines("\n".join(bad), allow) == bad


def test_frontend_routes_only_matching_pairs():
    from fastapi.testclient import TestClient
    from kestrel.disagg.frontend import Frontend
    d = tempfile.mkdtemp(prefix="kestrel-front-")
    for role, lay in (("context", _layout()), ("generation", _layout(page_size=32))):
        write_atomic(os.path.join(d, f"{role}.yaml"), {"url": f"http://127.0.0.1:9/{role}", "role": role,
                                                       "model": "m", "cache_layout": lay, "heartbeat": time.time()})
    front = Frontend(d)
    front.entries = read_entries(d)
    good, bad = front.pairs()
    assert not good and "page_size: context has 16, generation has 32" in bad[0]
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"})      # no lifespan: no polling
    assert r.status_code == 503 and r.json()["error"]["code"] == "layout_mismatch"
    assert "page_size: context has 16, generation has 32" in r.json()["error"]["message"]


def test_secondary_frontend_retries_a_seed_not_listening_yet():
    """The first frontend is published but its socket is not listening yet: the forwarded clock-offset route is
    retried until it answers, not failed."""
    import asyncio
    import socket
    import threading
    import uvicorn
    from fastapi import FastAPI
    from kestrel.disagg.frontend import Frontend
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))             # bound, not listening: connections are refused
    port = sock.getsockname()[1]
    d = tempfile.mkdtemp(prefix="kestrel-front-")
    now = time.time()
    write_atomic(os.path.join(d, "frontend-a.yaml"), {"url": f"http://127.0.0.1:{port}", "role": "frontend",
                                                      "model": "", "started": now - 10, "heartbeat": now + 60})
    write_atomic(os.path.join(d, "frontend-b.yaml"), {"url": "http://127.0.0.1:1", "role": "frontend",
                                                      "model": "", "started": now, "heartbeat": now + 60})
    seed = FastAPI()

    @seed.get("/disagg/clock-offsets")
    async def offsets():
        return {"http://c": {"offset": 1.5, "rtt": 0.001}}

    srv = uvicorn.Server(uvicorn.Config(seed, log_level="warning"))
    t = threading.Thread(target=lambda: (time.sleep(0.5), srv.run(sockets=[sock])), daemon=True)
    t.start()
    front = Frontend(d, url="http://127.0.0.1:1")

    async def go():
        await front.refresh()
        assert not front.is_seed()
        r = await front._forward_to_seed("/disagg/clock-offsets")
        await front.client.aclose()
        return r

    try:
        r = asyncio.run(go())
        assert r.status_code == 200 and json.loads(r.body) == {"http://c": {"offset": 1.5, "rtt": 0.001}}
    finally:
        srv.should_exit = True
        t.join(10)
        sock.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_handoff_between_bf16_pools(device):
    """Export from bf16 pools (fp32 recurrent state, a draft layer; the entries' byte offsets need alignment to be
    viewed back) to the host, import into another cache's fresh pages and slot; on a GPU the device checksum
    equals the host one."""
    from kestrel.config import ModelConfig
    from kestrel.runtime.cache import HybridCache
    from kestrel.runtime.request import Request
    config = ModelConfig.from_dir(H.model_dir())
    caches = [HybridCache(config, 64, 16, 4, 4, 16, torch.bfloat16, torch.device(device)) for _ in range(2)]
    for c in caches:
        c.add_layers({DRAFT: "mla"})
    src, dst = (Request(f"r{i}", list(range(40)), SamplingParams(), seed=0) for i in range(2))
    for c, r in zip(caches, (src, dst)):
        assert c.acquire_slot(r) and c.grow(r, 40)
    for name, layer in pool_entries(caches[0].pools):
        t = getattr(caches[0].pools, name)[layer]
        t.copy_(torch.randn(t.shape, device=device).to(t.dtype))
    src.pages = src.pages[::-1]         # pages in any order
    caches[0].block_tables_host[src.slot, :len(src.pages)] = torch.tensor(src.pages, dtype=torch.int32)
    state = export_state(caches[0].pools, src, 40)
    verify(state)
    assert all(off % 16 == 0 for *_, off, _ in state.manifest["entries"])
    assert state.buffer.device.type == "cpu" and state.buffer.is_pinned() == (device == "cuda")   # staged for DMA
    dev = state.buffer.to(device)
    assert checksum(dev, state.manifest, "wsum") == checksum(state.buffer, state.manifest, "wsum")
    from kestrel.runtime.handoff import import_state
    import_state(caches[1].pools, dst, state)
    for name, layer in pool_entries(caches[0].pools):
        a, b = getattr(caches[0].pools, name)[layer], getattr(caches[1].pools, name)[layer]
        if name == "mla":
            assert torch.equal(a[torch.tensor(src.pages)], b[torch.tensor(dst.pages)])
        else:
            assert torch.equal(a[src.slot], b[dst.slot])


def _retry_frontend(n_context: int, fail):
    """A frontend over `n_context` context servers and one generation server, all answered by `fail(kind, url, n)`
    through a mock transport (kind `prefill` or `generate`, n: the calls of that kind so far); returns the frontend
    and the list of (kind, url) calls it made."""
    import httpx
    from kestrel.disagg.frontend import Frontend
    d = tempfile.mkdtemp(prefix="kestrel-front-")
    urls = [f"http://c{i}:1" for i in range(n_context)]
    for i, u in enumerate(urls + ["http://g:1"]):
        role = "context" if u in urls else "generation"
        write_atomic(os.path.join(d, f"{role}{i}.yaml"), {"url": u, "role": role, "model": "m",
                                                          "cache_layout": _layout(), "heartbeat": time.time()})
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        kind = "prefill" if "/disagg/prefill/" in request.url.path else "generate"
        calls.append((kind, url, request.headers.get("x-kestrel-fault")))
        answer = fail(kind, url, sum(k == kind for k, *_ in calls) - 1, request)
        if answer is not None:
            return answer
        if kind == "prefill":
            return httpx.Response(200, json={"transport": {"zmq": f"tcp://{url}"}, "transfers": [{"tid": url}]})
        return httpx.Response(200, json={"choices": [{"text": "ok from " + json.loads(
            request.headers["x-kestrel-handoff"])["transfers"][0]["tid"]}]})

    front = Frontend(d, prefill_timeout=0.5)
    front.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    front.entries = read_entries(d)
    return front, calls


def _lost(message="the request's cache state did not arrive from the context server: its transport is not "
                  "listening; it may have died"):
    import httpx
    return httpx.Response(502, json={"error": {"message": message, "type": "server_error", "param": None,
                                               "code": "context_state_lost"}})


@pytest.mark.parametrize("how", ["refused", "reset", "timeout", "shutting-down", "state-lost"])
def test_frontend_retries_a_failed_context_server_once_on_another(how):
    """The first context server fails before the hand-off completed: the request runs again from its prompt on
    the other one (without the test's fault header), the failed server is skipped afterwards."""
    import httpx
    from fastapi.testclient import TestClient

    def fail(kind, url, n, request):
        if kind == "prefill" and n == 0:
            if how == "refused":
                raise httpx.ConnectError("refused", request=request)
            if how == "reset":
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
            if how == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            if how == "shutting-down":
                return httpx.Response(503, json={"error": {"message": "shutting down", "code": "shutting_down"}})
        if how == "state-lost" and kind == "generate" and n == 0:
            return _lost()
        return None

    front, calls = _retry_frontend(2, fail)
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"}, headers={"x-kestrel-fault": "x"})
    first, second = [c for c in calls if c[0] == "prefill"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == f"ok from {second[1]}"
    # the fault header goes to the first server that received the request only (a refused one received nothing)
    assert first[1] != second[1] and first[2] == "x" and second[2] == ("x" if how == "refused" else None)
    assert [e.url for e in front.live("context")] == [second[1]]


def test_frontend_retries_at_most_once_then_fails_clearly():
    """Every context server fails after receiving the request: two are tried (not the third), and the client gets
    the last failure's error."""
    import httpx
    from fastapi.testclient import TestClient

    def lose(kind, url, n, request):
        return _lost() if kind == "generate" else None

    front, calls = _retry_frontend(3, lose)
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"})
    err = H.assert_error_shape(r, 502, None)
    assert err["code"] == "context_state_lost" and "may have died" in err["message"]
    assert len({c[1] for c in calls if c[0] == "prefill"}) == 2 and len(calls) == 4

    def reset(kind, url, n, request):
        raise httpx.RemoteProtocolError("Server disconnected", request=request)

    front, calls = _retry_frontend(3, reset)
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"})
    err = H.assert_error_shape(r, 503, None)
    assert err["code"] == "context_server_lost" and "RemoteProtocolError" in err["message"] and len(calls) == 2

    def refuse_two(kind, url, n, request):     # refused connections ran nothing: the third server still gets it
        if kind == "prefill" and n < 2:
            raise httpx.ConnectError("refused", request=request)
        return _lost() if kind == "generate" else None

    front, calls = _retry_frontend(3, refuse_two)
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"})
    assert H.assert_error_shape(r, 502, None)["code"] == "context_state_lost"
    assert len({c[1] for c in calls if c[0] == "prefill"}) == 3 and not front.live("context")


@pytest.mark.parametrize("status,code", [(502, "kv_transfer_failed"), (400, "invalid_value"),
                                         (409, "layout_mismatch")])
def test_frontend_does_not_retry_what_another_context_server_would_not_change(status, code):
    """A corrupt transfer (already pulled twice), a refused request or a layout refusal goes to the client as the
    generation server words it, with one context server tried."""
    import httpx
    from fastapi.testclient import TestClient

    def refuse(kind, url, n, request):
        if kind == "generate":
            return httpx.Response(status, json={"error": {"message": "no", "type": "x", "param": None,
                                                          "code": code}})
        return None

    front, calls = _retry_frontend(2, refuse)
    r = TestClient(front.app).post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert len(calls) == 2
