"""Disaggregated serving: context servers run prompts, generation servers decode, a frontend routes between them.

- `discovery.py`: every server publishes one YAML file (URL, role, model, cache and parallel layout, heartbeat) in
  a shared directory; readers drop stale entries.
- `handshake.py`: the cache layout a server publishes and the comparison that names the first difference.
- `transport.py`: moving a packed request state (runtime/handoff.py) from a context server to a generation server:
  ZMQ over TCP always, NIXL where it imports; a checksum on every transfer.
- `clocks.py`: steady-clock offsets between processes, so per-request timings line up.
- `worker.py`: the context and generation routes a `kestrel serve --role context|generation` server adds.
- `frontend.py`: the OpenAI API in front of them (`--role frontend`).
"""
