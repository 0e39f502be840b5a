"""Shared by the server tests: one tiny checkpoint, one `kestrel serve` subprocess on a free port, the offline
`LLM` on the same checkpoint, and a way to run a small ASGI app (a stub server) in a thread.

The checkpoint, server and LLM are made once per test process (the first test that asks) and torn down at exit, so
test_serve_*, test_bench_serve and the others share them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
MAX_MODEL_LEN = 512

_state: dict = {}


def model_dir() -> str:
    if "dir" not in _state:
        from kestrel.models.kimi.checkpoint import make_checkpoint
        d = tempfile.mkdtemp(prefix="kestrel-serve-test-")
        atexit.register(shutil.rmtree, d, True)
        make_checkpoint("k3-tiny", os.path.join(d, "tiny"), dtype=torch.float32)
        _state["dir"] = os.path.join(d, "tiny")
    return _state["dir"]


class ServerProcess:
    """`kestrel serve` in a subprocess, on a port the OS picks; its log goes to a file."""

    _count = 0

    def __init__(self, model: str, *extra: str, api_key: str | None = API_KEY, timeout: float = 180):
        ServerProcess._count += 1
        self.log_path = os.path.join(os.path.dirname(model), f"serve-{ServerProcess._count}-{os.getpid()}.log")
        cmd = [sys.executable, "-m", "kestrel.cli", "serve", "--model", model, "--port", "0", "--no-access-log",
               "--max-model-len", str(MAX_MODEL_LEN), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = self._wait_ready(timeout)
        self.api_key = api_key

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            m = re.search(r"serving \S+ at (http://[^\s/]+)/v1", text)
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"kestrel serve exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kestrel serve did not start in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def server() -> ServerProcess:
    if "server" not in _state:
        s = ServerProcess(model_dir())
        atexit.register(s.stop)
        _state["server"] = s
    s = _state["server"]
    assert s.proc.poll() is None, f"the test server died:\n{s.log()}"
    return s


# The server with small limits that the hardening and fuzz tests share: a second key from a file, a served model
# name, an extra allowed Host name, and one-second header and body timeouts.
LIMITED = {"max_request_bytes": 65536, "max_choices": 8, "max_stop": 4, "max_stop_chars": 16,
           "max_request_tokens": 4}
FILE_KEY = "key-from-file"
SERVED_NAME = "kimi-tiny"
EXTRA_HOST = "kestrel.example"


def limited_server() -> ServerProcess:
    if "limited" not in _state:
        key_file = os.path.join(os.path.dirname(model_dir()), "keys.txt")
        with open(key_file, "w") as f:
            f.write(f"# accepted keys\n\n{FILE_KEY}\n")
        flags = [a for k, v in LIMITED.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        s = ServerProcess(model_dir(), "--api-key-file", key_file, "--served-model-name", SERVED_NAME,
                          "--allowed-hosts", EXTRA_HOST, "--header-timeout", "1", "--body-timeout", "1", *flags)
        atexit.register(s.stop)
        _state["limited"] = s
    s = _state["limited"]
    assert s.proc.poll() is None, f"the limited test server died:\n{s.log()}"
    return s


def llm():
    """The offline engine on the same checkpoint and engine settings as the server."""
    if "llm" not in _state:
        from kestrel import LLM
        _state["llm"] = LLM(model_dir(), max_model_len=MAX_MODEL_LEN)
    return _state["llm"]


@contextlib.contextmanager
def single_thread():
    """Tiny models run fastest with one intra-op thread (and a busy 2-core machine suffers badly otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def app_in_thread(app):
    """Serve an ASGI app with uvicorn in a background thread; yields its base URL."""
    import uvicorn
    sock = free_socket()
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline or not t.is_alive():
            raise RuntimeError("the stub server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(15)
        sock.close()


def metrics(url: str, api_key: str | None = API_KEY) -> dict[str, float]:
    import httpx
    from kestrel.serve.metrics import parse_prometheus
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    assert r.status_code == 200, r.text
    return parse_prometheus(r.text)


def wait_metrics(url: str, pred, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if pred(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"/metrics did not reach the expected state in {timeout} s: "
                                 + str({k: v for k, v in m.items() if "bucket" not in k}))
        time.sleep(0.1)


def metric_value(values: dict[str, float], name: str, **labels: str) -> float:
    from kestrel.serve.metrics import metric
    v = metric(values, name, **labels)
    assert v is not None, f"/metrics has no {name} {labels}"
    return v


def assert_error_shape(r, status: int, param: str | None) -> dict:
    """`r` is an error answer in OpenAI's shape with this status and param; returns its `error` object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] == param
    if param is not None:
        assert param.split(".")[0].split("[")[0] in err["message"]
    return err
