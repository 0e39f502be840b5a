"""Servers find each other through a shared directory: one YAML file per server.

Each server writes `<role>-<host>-<port>.yaml` (atomically: a temporary file in the same directory, then
`os.replace`, so a reader never sees half a file) holding its URL as a string, role, model, cache layout, parallel
layout, start time and heartbeat time (wall-clock seconds: comparable across processes and hosts with synced
clocks), and rewrites it every `interval` seconds from a thread. A reader keeps the entries whose heartbeat is
younger than `stale_after` and drops the others (deleting files whose heartbeat is far older still). A server
that stops removes its own file.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field

import yaml

log = logging.getLogger("kestrel.disagg")

ROLES = ("context", "generation", "frontend", "both")


@dataclass
class Entry:
    url: str
    role: str
    model: str
    cache_layout: dict = field(default_factory=dict)
    parallel_layout: dict = field(default_factory=dict)
    transport: dict = field(default_factory=dict)      # where the context server's state transport listens
    started: float = 0.0
    heartbeat: float = 0.0
    pid: int = 0
    path: str = ""

    def to_dict(self) -> dict:
        return {"url": str(self.url), "role": self.role, "model": self.model, "cache_layout": self.cache_layout,
                "parallel_layout": self.parallel_layout, "transport": self.transport, "started": self.started,
                "heartbeat": self.heartbeat, "pid": self.pid}


def _file_name(role: str, url: str) -> str:
    return f"{role}-{re.sub(r'[^A-Za-z0-9]+', '_', url.split('://', 1)[-1]).strip('_')}.yaml"


def write_atomic(path: str, data: dict) -> None:
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".yaml", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Publisher:
    """Keeps one server's entry fresh in the discovery directory until `stop`."""

    def __init__(self, directory: str, entry: Entry, interval: float = 1.0):
        os.makedirs(directory, exist_ok=True)
        self.entry, self.interval = entry, interval
        entry.started = entry.started or time.time()
        entry.pid = os.getpid()
        entry.path = os.path.join(directory, _file_name(entry.role, entry.url))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.entry.heartbeat = time.time()
        write_atomic(self.entry.path, self.entry.to_dict())

    def start(self) -> "Publisher":
        self.beat()
        self._thread = threading.Thread(target=self._run, name="kestrel-discovery", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError as e:          # a full or vanished directory: say so, keep trying
                log.warning("discovery: cannot write %s (%s)", self.entry.path, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            os.unlink(self.entry.path)
        except OSError:
            pass


def read_entries(directory: str, stale_after: float = 5.0, now: float | None = None,
                 remove_after: float | None = 60.0) -> list[Entry]:
    """The live entries of the directory, oldest server first; stale ones are dropped (and their files removed
    once they are `remove_after` seconds old); unreadable files are skipped."""
    now = time.time() if now is None else now
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".yaml") or name.startswith(".tmp-"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
            e = Entry(url=str(d["url"]), role=str(d["role"]), model=str(d.get("model", "")),
                      cache_layout=d.get("cache_layout") or {}, parallel_layout=d.get("parallel_layout") or {},
                      transport=d.get("transport") or {}, started=float(d.get("started", 0)),
                      heartbeat=float(d["heartbeat"]), pid=int(d.get("pid", 0)), path=path)
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
            continue            # being replaced, or not ours
        age = now - e.heartbeat
        if age > stale_after:
            if remove_after is not None and age > remove_after:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            continue
        out.append(e)
    out.sort(key=lambda e: (e.started, e.url))
    return out
