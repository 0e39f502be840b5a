"""A rank that dies ends the whole group in bounded time, with an error naming the rank, and leaves no process.

The CLI path (`kestrel generate --tensor-parallel-size 2`: the command supervises its rank processes) and the
in-process path (`LLM(..., tensor_parallel_size=2)`: the calling process supervises them) share `supervise`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO, tiny_checkpoint
from kestrel import LLM, SamplingParams
from kestrel.parallel.launch import RankDied

BOUND_S = 30          # the group is gone this long after the kill (detection 0.1 s + SIGTERM grace 5 s + reaping)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie has exited; only its parent's wait is missing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_cli_rank_killed_mid_step_stops_the_group():
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kestrel.cli", "generate", "--model", tiny_checkpoint("kimi-linear-tiny"),
           "--device", "cpu", "--tensor-parallel-size", "2", "--kv-cache-tokens", "4096", "--max-tokens", "3000",
           "--ignore-eos", "hello"]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids, lines = {}, []
    try:
        for line in sup.stderr:
            lines.append(line)
            m = re.search(r"started rank (\d+) \(pid (\d+)\)", line)
            if m:
                pids[int(m.group(1))] = int(m.group(2))
            if "generated" in line or "error" in line:
                break
            if re.search(r"rank 1\] .*rank 1 of tp2", line):     # rank 1 loaded: the steps start now
                break
        assert len(pids) == 2, "".join(lines)
        out = sup.stdout.read(3)          # rank 0 streams tokens: the group is stepping
        assert out
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        rest = sup.communicate(timeout=BOUND_S)[1]
        took = time.monotonic() - t0
    finally:
        if sup.poll() is None:
            sup.kill()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert sup.returncode == 2
    errors = [ln for ln in rest.splitlines() if ln.startswith("kestrel: error:")]
    assert errors == [f"kestrel: error: rank 1 (pid {pids[1]}) was killed by SIGKILL; the other ranks were stopped"]
    assert took < BOUND_S
    assert not any(alive(pid) for pid in pids.values())


def test_llm_rank_killed_mid_generate_raises_naming_it():
    llm = LLM(tiny_checkpoint("kimi-linear-tiny"), device="cpu", tensor_parallel_size=2, kv_cache_tokens=4096)
    pids = llm.rank_pids
    try:
        threading.Timer(2.0, os.kill, (pids[1], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RankDied, match=rf"^rank 1 \(pid {pids[1]}\) was killed by SIGKILL"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3000, ignore_eos=True))
        assert time.monotonic() - t0 < 2.0 + BOUND_S
    finally:
        llm.close()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
