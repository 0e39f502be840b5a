"""Steady-clock offsets between processes, so that timestamps taken by several servers line up.

Every disaggregated server answers `GET /disagg/clock` with its `time.monotonic()`. A frontend estimates a
peer's offset the NTP way: it reads its own clock before (t0) and after (t1) the call, assumes the peer read its
clock half way, and keeps the sample with the shortest round trip: offset = peer - (t0 + t1) / 2, uncertain by
half that round trip. `to_local(t, offset)` maps a peer's timestamp onto this process's clock.

The first frontend of a discovery directory is the clock reference (the "seed"): it measures every server and
answers `GET /disagg/clock-offsets`; a secondary frontend measures only its own offset to the first one and
forwards that route there, so the timings of every frontend are on one clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Offset:
    offset: float        # peer clock - local clock, seconds
    rtt: float           # round trip of the best sample: the offset is good to +- rtt / 2
    measured_at: float


def estimate(samples: list[tuple[float, float, float]]) -> Offset:
    """From (t0 local, peer, t1 local) samples: the offset of the sample with the shortest round trip."""
    if not samples:
        raise ValueError("no clock samples")
    t0, peer, t1 = min(samples, key=lambda s: s[2] - s[0])
    return Offset(peer - (t0 + t1) / 2, t1 - t0, t1)


async def measure(client, url: str, samples: int = 5, headers: dict | None = None) -> Offset:
    """Offset of the server at `url` (an httpx.AsyncClient does the calls)."""
    got = []
    for _ in range(samples):
        t0 = time.monotonic()
        r = await client.get(f"{url}/disagg/clock", headers=headers or {})
        t1 = time.monotonic()
        r.raise_for_status()
        got.append((t0, float(r.json()["monotonic"]), t1))
    return estimate(got)


def to_local(t: float | None, offset: Offset | float | None) -> float | None:
    if t is None:
        return None
    if offset is None:
        return t
    return t - (offset.offset if isinstance(offset, Offset) else offset)


def ttft_split(c: dict, g: dict, c_off, g_off, received: float, first_byte: float | None) -> dict:
    """The frontend's per-request record on its own clock: queue (context server: arrival to first scheduled),
    prefill (first scheduled to first token sampled), transfer (first token on the context server to the state
    verified on the generation server), first decode (verified to the first token leaving for the client:
    import into the pools and the first streamed output), and the whole TTFT as the frontend saw it. Where the
    servers sent the finer timestamps, route and transfer are split further: `route_http` (the frontend's request
    reaching the context server's route) + `admit` (parsing, then the wait for the engine: a step in flight holds
    it); `export` (the state copied out and checksummed in the engine's thread), `relay` (the context server's
    answer through the frontend to the generation server's route), `pull` and `verify` (the bytes' transport and
    their checksum on the generation server; the rest of transfer is the generation server parsing the request)."""
    arr, sch, tok = (to_local(c.get(k), c_off) for k in ("arrival", "first_scheduled", "first_token"))
    ver = to_local(g.get("verified"), g_off)

    def d(a, b):
        return None if a is None or b is None else max(0.0, b - a)

    out = {"route": d(received, arr), "queue": d(arr, sch), "prefill": d(sch, tok), "transfer": d(tok, ver),
           "first_decode": d(ver, first_byte), "ttft": d(received, first_byte)}
    c_in, exp, ans = (to_local(c.get(k), c_off) for k in ("received", "exported", "answered"))
    if c_in is not None:
        out.update(route_http=d(received, c_in), admit=d(c_in, arr))
    if exp is not None:
        out["export"] = d(tok, exp)
    if ans is not None:
        out["relay"] = d(ans, to_local(g.get("received"), g_off))
    for k in ("pull_s", "verify_s"):
        if g.get(k) is not None:
            out[k[:-2]] = float(g[k])
    return out
