"""benchmarks/spec_bench.py in its CPU mode (`--device cpu --tiny`: the tiny K3 reference model, a random tiny
drafter): it runs, and its JSON has the fast-path issue's record fields plus the speculation ones, with times that
are measured (positive), an acceptance the engine measured, and the policy's switch-off batch per acceptance."""

from __future__ import annotations

import json
import os
import subprocess

from helpers import PYTHON, REPO

ISSUE9_FIELDS = {"model", "weights", "phase", "batch", "context", "sampling", "tokens_per_s", "floor_tokens_per_s"}
SPEC_FIELDS = {"accept_len", "draft_ms", "draft_eager_ms", "draft_host_ms", "propose_graph_replays", "verify_ms",
               "decode_ms", "num_speculative_tokens", "break_even", "speedup_measured", "speedup_predicted",
               "speedup_at_code", "speedup_at_creative"}


def test_spec_bench_cpu_tiny_writes_its_records(tmp_path):
    out = tmp_path / "spec.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([PYTHON, os.path.join(REPO, "benchmarks", "spec_bench.py"), "--device", "cpu", "--tiny",
                        "--out", str(out)], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert {"machine", "command", "records", "note", "policy_off_above_batch"} <= set(rep)
    assert [rec["batch"] for rec in rep["records"]] == [1, 4]
    for rec in rep["records"]:
        assert ISSUE9_FIELDS | SPEC_FIELDS <= set(rec), sorted(ISSUE9_FIELDS | SPEC_FIELDS - set(rec))
        assert rec["phase"] == "decode" and rec["sampling"] == "greedy" and rec["num_speculative_tokens"] == 3
        assert rec["verify_steps"] == 4 and 1.0 <= rec["accept_len"] <= 4.0
        assert min(rec["decode_ms"], rec["verify_ms"], rec["draft_ms"], rec["tokens_per_s"]) > 0
        # the policy's formula on the record's own times
        assert abs(rec["break_even"] - (rec["draft_ms"] + rec["verify_ms"]) / rec["decode_ms"]) < 1e-3
        assert abs(rec["speedup_at_code"] - 4.7 / rec["break_even"]) < 1e-3
    off = rep["policy_off_above_batch"]["K3"]
    assert set(off) == {"measured", "code", "creative"} and all(v in (0, 1, 4) for v in off.values())
    assert "policy: speculation on up to batch" in r.stdout
