"""Starting the ranks of a layout, and stopping them all when one dies.

- `kestrel generate | serve` with a layout of several ranks, started by hand: the command becomes a supervisor that
  starts one process per local rank (`python -m kestrel.cli <same arguments>` with torchrun's variables RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), watches them, and when one exits with an error or a
  signal, stops the others (SIGTERM, then SIGKILL) and reports which rank died. `--nnodes` / `--node-rank` /
  `--master-addr` / `--master-port` start this host's share of a group over several hosts.
- Under `torchrun` (RANK and WORLD_SIZE already set) each process is one rank: nothing is spawned, and torchrun's
  agent stops the group when a worker fails.
- `LLM(..., tensor_parallel_size=N)` in a Python process: `RankGroup` spawns the ranks (multiprocessing, spawn),
  sends rank 0 the calls over a pipe and watches the ranks while it waits for the answer.

Each rank joins the process group with `init_group` (gloo on CPUs, NCCL on GPUs, one GPU per local rank).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

from kestrel.errors import ConfigError, KestrelError
from kestrel.parallel.mapping import Mapping, check_port_free, check_world, env_rank, free_port

log = logging.getLogger("kestrel.parallel")

GROUP_TIMEOUT_S = 120        # a collective that waits longer than this fails (a rank that hangs, not one that dies)
STOP_GRACE_S = 5.0           # after SIGTERM, seconds a rank gets before SIGKILL
POLL_S = 0.1


class RankDied(KestrelError):
    """A rank of the group exited with an error or was killed; the others were stopped."""


def init_group(ec, device_type: str) -> Mapping:
    """Join this process's rank to the group (torchrun's environment variables) and return its `Mapping`."""
    import torch
    import torch.distributed as dist
    env = env_rank()
    if env is None:
        raise ConfigError(f"the layout needs {ec.world_size} ranks but this process is not one (no RANK / "
                          "WORLD_SIZE); run it through `kestrel` (which starts them) or torchrun")
    rank, local_rank, world = env
    check_world(ec.world_size, world)
    mapping = Mapping.from_engine_config(ec, rank, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return mapping


def rendezvous(ec) -> tuple[str, int]:
    """The group's address and port: the given port (checked free on the first host) or a free one."""
    addr = ec.master_addr
    if ec.master_port is None:
        if ec.nnodes > 1:
            raise ConfigError("--nnodes > 1 needs --master-port (every host must name the same port)")
        return addr, free_port(addr if addr != "localhost" else "127.0.0.1")
    if ec.node_rank == 0:
        check_port_free(addr, ec.master_port)
    return addr, ec.master_port


def rank_env(ec, local_rank: int, addr: str, port: int) -> dict[str, str]:
    local_world = ec.world_size // ec.nnodes
    return {"RANK": str(ec.node_rank * local_world + local_rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(ec.world_size), "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


def check_nodes(ec) -> None:
    if ec.world_size % ec.nnodes:
        raise ConfigError(f"--nnodes {ec.nnodes} does not divide the layout's {ec.world_size} ranks; every host "
                          "runs the same number of ranks")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs) -> None:
    """SIGTERM every live process, SIGKILL whatever is left after the grace period; reap them all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if p.poll() is None:
            p.kill()
        p.wait()


def supervise(procs: list, first_rank: int, done=None) -> int | None:
    """Wait until every process exits 0, or one fails: then stop the others and raise `RankDied` naming the rank.
    `done()` returning True also ends the wait (the caller's answer arrived); returns None then."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            # several found dead at one poll: name the cause, not its echo. A rank whose peer vanished aborts in
            # its collective (SIGABRT) or exits with an error within milliseconds; a rank killed by another
            # signal went first
            i = min(failed, key=lambda j: (codes[j] == -signal.SIGABRT, codes[j] > 0, j))
            _stop(procs)
            raise RankDied(f"rank {first_rank + i} (pid {procs[i].pid}) {_describe(codes[i])}; the other ranks "
                           "were stopped")
        if all(c == 0 for c in codes):
            return 0
        if done is not None and done():
            return None
        time.sleep(POLL_S)


def launch_cli(argv: list[str], ec) -> int:
    """`kestrel generate | serve` over several ranks: start this host's ranks, supervise them; the exit status is
    rank 0's (or 1 with one error line when a rank died)."""
    check_nodes(ec)
    addr, port = rendezvous(ec)
    local_world = ec.world_size // ec.nnodes
    procs = []
    forward = {}
    try:
        for r in range(local_world):
            env = {**os.environ, **rank_env(ec, r, addr, port)}
            procs.append(subprocess.Popen([sys.executable, "-m", "kestrel.cli", *argv], env=env))
            log.info("started rank %d (pid %d)", ec.node_rank * local_world + r, procs[-1].pid)
        # a stop asked of the supervisor goes to rank 0, which owns the shutdown (a server drains its requests)
        # and then releases the other ranks; the finally below stops whatever is left
        for sig in (signal.SIGINT, signal.SIGTERM):
            forward[sig] = signal.signal(sig, lambda s, f: procs[0].poll() is None and procs[0].send_signal(s))
        supervise(procs, ec.node_rank * local_world)
        return 0
    finally:
        for sig, old in forward.items():
            signal.signal(sig, old)
        _stop(procs)


# ---------------------------------------------------------------------------------------------------------------
# ranks of an in-process LLM

class _Process:
    """multiprocessing.Process with the poll / terminate / kill / wait surface of subprocess.Popen."""

    def __init__(self, proc):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self):
        return self.proc.exitcode

    def terminate(self):
        self.proc.terminate()

    def kill(self):
        self.proc.kill()

    def wait(self):
        self.proc.join()


class RankGroup:
    """The ranks of an `LLM` over several processes, each running `worker(arg, conn)` (`arg` defaults to the
    EngineConfig; `conn` is rank 0's end of the pipe, None elsewhere). `call(name, *args)` sends rank 0 a call
    and returns its answer; a rank that dies meanwhile raises `RankDied` naming it, the others stopped."""

    def __init__(self, ec, worker, arg=None):
        check_nodes(ec)
        if ec.nnodes > 1:
            raise ConfigError("an in-process LLM runs its ranks on one host; use torchrun or `kestrel serve` with "
                              "--nnodes for several hosts")
        addr, port = rendezvous(ec)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.procs: list[_Process] = []
        for r in range(ec.world_size):
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(worker, ec if arg is None else arg, rank_env(ec, r, addr, port),
                                  child if r == 0 else None))
            p.start()
            self.procs.append(_Process(p))
        child.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, name: str, *args):
        try:
            self.conn.send((name, args))
        except (BrokenPipeError, OSError):
            pass                              # rank 0 is gone: supervise() names it
        supervise(self.procs, 0, done=self.conn.poll)
        try:
            kind, value = self.conn.recv()
        except EOFError:
            supervise(self.procs, 0)
            raise RankDied("rank 0 closed its pipe without an answer")
        if kind == "error":
            # a collective that failed on rank 0 usually means another rank died: name that one if so
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and all(p.poll() in (None, 0) for p in self.procs[1:]):
                time.sleep(POLL_S)
            if any(p.poll() not in (None, 0) for p in self.procs[1:]):
                supervise(self.procs, 0)
            raise value
        return value

    def close(self) -> None:
        if all(p.poll() is None for p in self.procs):
            try:
                self.call("close")
            except (KestrelError, OSError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        _stop(self.procs)


def _rank_main(worker, arg, env: dict, conn) -> None:
    os.environ.update(env)
    worker(arg, conn)
