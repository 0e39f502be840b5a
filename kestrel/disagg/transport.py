"""Moving packed request states (runtime/handoff.py) from a context server to a generation server.

The context server keeps each exported state in a `StateStore` until the generation server acknowledges it (or
`hold` seconds pass) and answers on one ZMQ ROUTER socket (TCP), served by a thread:
- `hello` {layout}: the handshake; the answer carries this side's layout, or the first difference.
- `pull` {tid}: the manifest, checksum and frame sizes, then the state's bytes as zero-copy frames of at most
  `FRAME_BYTES` each, all in one multipart message (ZMQ delivers it whole or not at all, in order). Frames, not one
  big message: libzmq allocates each received message on its own, and a message past glibc's mmap threshold
  (32 MB at most) is fresh, page-faulting memory on every pull; the client copies each frame into one buffer
  (pinned when its pools are on a GPU) and checks the count and the size of every frame against the header.
- `nixl` {tid, agent}: registers the state's buffer with this process's NIXL agent and answers its metadata and
  the buffer's address, so the generation server READs the bytes itself (the NIXL transport, where `nixl`
  imports on both sides; its control messages still go over ZMQ).
- `ack` {tid}: the state arrived whole; it is dropped here.
The generation server checks the checksum of what arrived (`handoff.verify`) before anything lands in its pools.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid

import torch
import zmq

from kestrel.disagg.handshake import first_difference
from kestrel.runtime.handoff import HandoffError, PackedState, host_buffer

log = logging.getLogger("kestrel.disagg")

FRAME_BYTES = 4 << 20       # a state's bytes travel in frames of this size (the last one shorter)


class TransportError(HandoffError):
    """The peer did not answer, or answered with an error (the message says which)."""


def nixl_api():
    """(nixl_agent, nixl_agent_config) where a NIXL wheel imports, else None."""
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            m = __import__(mod, fromlist=["nixl_agent"])
            return m.nixl_agent, m.nixl_agent_config
        except Exception:       # not installed, or installed without its libraries (no CUDA, no UCX)
            continue
    return None


class _Nixl:
    """One NIXL agent per process (UCX backend), created on first use. The agent is not safe to drive from several
    threads at once (concurrent register / transfer calls corrupted the heap in a test), so every use holds
    `busy`: one NIXL operation at a time per process."""
    _lock = threading.Lock()
    busy = threading.RLock()
    _agent = None
    _remotes: dict[bytes, str] = {}

    @classmethod
    def agent(cls):
        with cls._lock:
            if cls._agent is None:
                api = nixl_api()
                if api is None:
                    raise TransportError("the NIXL transport was asked for but `nixl` does not import here; "
                                         "install it (pip install nixl) or use --kv-transport zmq")
                agent_cls, config_cls = api
                cls._agent = agent_cls(f"kestrel-{uuid.uuid4().hex[:12]}", config_cls(backends=["UCX"]))
            return cls._agent

    @classmethod
    def remote(cls, metadata: bytes) -> str:
        with cls._lock:
            if metadata == cls._agent.get_agent_metadata():      # both sides in one process: a local read
                return cls._agent.name
            name = cls._remotes.get(metadata)
            if name is None:
                name = cls._agent.add_remote_agent(metadata)
                cls._remotes[metadata] = name
            return name


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


class StateStore:
    """Exported states by transfer id, each kept until acknowledged or `hold` seconds old."""

    def __init__(self, hold: float = 30.0):
        self.hold = hold
        self._states: dict[str, tuple[PackedState, float]] = {}
        self._nixl_regs: dict[str, object] = {}
        self._lock = threading.Lock()

    def put(self, tid: str, state: PackedState) -> None:
        with self._lock:
            self._states[tid] = (state, time.monotonic() + self.hold)

    def get(self, tid: str) -> PackedState | None:
        self.expire()
        with self._lock:
            got = self._states.get(tid)
        return got[0] if got else None

    def drop(self, tid: str) -> None:
        with self._lock:
            self._states.pop(tid, None)
            reg = self._nixl_regs.pop(tid, None)
        if reg is not None:
            with _Nixl.busy:
                _Nixl.agent().deregister_memory(reg)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [tid for tid, (_, t) in self._states.items() if t < now]
        for tid in old:
            log.warning("handoff %s was not collected within %.0f s; dropped", tid, self.hold)
            self.drop(tid)

    def register_nixl(self, tid: str, state: PackedState):
        with self._lock:
            if tid in self._nixl_regs:
                return
        with _Nixl.busy:
            reg = _Nixl.agent().register_memory([state.buffer])
        with self._lock:
            self._nixl_regs[tid] = reg

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)


def split_frames(buffer: torch.Tensor, frame_bytes: int | None = None) -> list[memoryview]:
    """A host copy of `buffer` (none when it is on the host already) cut into zero-copy views of `frame_bytes`
    (default FRAME_BYTES)."""
    frame_bytes = frame_bytes or FRAME_BYTES
    whole = memoryview(buffer.cpu().numpy())
    return [whole[a:a + frame_bytes] for a in range(0, len(whole), frame_bytes)]


def join_frames(reply: dict, frames: list, what: str, pin: bool = False) -> torch.Tensor:
    """The frames of a `pull` answer in one host buffer, after checking that their count and every size are the
    ones the header announced (a frame lost or cut on the way is refused here; bytes moved between frames of one
    size are the checksum's to catch)."""
    sizes, nbytes = reply.get("frames"), reply.get("nbytes")
    views = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames]
    if not isinstance(sizes, list) or sum(sizes) != nbytes:
        raise TransportError(f"{what} announced {nbytes} bytes in frames {sizes}: a malformed answer")
    if [len(v) for v in views] != sizes:
        raise TransportError(f"{what} came as {len(views)} frames of {[len(v) for v in views]} bytes, "
                             f"{len(sizes)} of {sizes} announced: frames were lost or cut on the way")
    buf = host_buffer(nbytes, pin)
    whole, off = memoryview(buf.numpy()), 0
    for v in views:                 # a memcpy each (ZMQ's frames are read-only: torch.frombuffer would warn)
        whole[off:off + len(v)] = v.cast("B")
        off += len(v)
    return buf


class StateServer:
    """The context server's side: a ROUTER socket on `host` (any free port) answered by one thread."""

    def __init__(self, store: StateStore, layout: dict, host: str = "127.0.0.1"):
        self.store, self.layout = store, layout
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.nixl = nixl_api() is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kestrel-kv-transport", daemon=True)

    def start(self) -> "StateServer":
        self._thread.start()
        return self

    def describe(self) -> dict:
        return {"zmq": self.address, "nixl": self.nixl}

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                self.store.expire()
                continue
            ident, *frames = self.sock.recv_multipart(copy=True)
            try:
                msg = json.loads(frames[-1])
                reply, payload = self._answer(msg)
            except Exception as e:       # a bad message must not stop the transport: answer it
                reply, payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}, None
            out = [ident, json.dumps(reply).encode()]
            if payload is not None:
                out += payload
            self.sock.send_multipart(out, copy=False)

    def _answer(self, msg: dict):
        op = msg.get("op")
        if op == "hello":
            why = first_difference(self.layout, msg.get("layout") or {})
            return {"ok": why is None, "error": why, "layout": self.layout}, None
        tid = str(msg.get("tid"))
        if op == "ack":
            self.store.drop(tid)
            return {"ok": True}, None
        state = self.store.get(tid)
        if state is None:
            return {"ok": False, "error": f"no exported state {tid} here (never made, or held past its "
                                          f"{self.store.hold:.0f} s and dropped)"}, None
        head = {"ok": True, "manifest": state.manifest, "checksum": state.checksum, "nbytes": state.nbytes}
        if op == "pull":
            frames = split_frames(state.buffer)
            head["frames"] = [len(f) for f in frames]
            return head, frames
        if op == "nixl":
            self.store.register_nixl(tid, state)
            head.update(addr=state.buffer.data_ptr(), device=state.buffer.get_device() if state.buffer.is_cuda else 0,
                        mem=_mem_type(state.buffer))
            with _Nixl.busy:
                return head, [_Nixl.agent().get_agent_metadata()]
        return {"ok": False, "error": f"unknown operation {op!r}"}, None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


class StateClient:
    """The generation server's side: one request and its answer per call, waiting at most `timeout` seconds, on a
    DEALER socket per thread and peer that stays connected between calls (no TCP and ZMTP handshake per pull).
    The socket only sends over a live connection (ZMQ_IMMEDIATE): when there is none (a new socket, or the peer
    went away) a plain TCP connect first tells a dead peer (refused) at once, since ZMQ would silently reconnect
    forever. A call that fails or times out closes its socket: an answer still on the way is never read as the
    next call's."""

    def __init__(self, timeout: float = 30.0, pin_memory: bool = False):
        self.timeout = timeout
        self.pin_memory = pin_memory               # ZMQ pulls land in pinned memory (pools on a GPU)
        self.ctx = zmq.Context.instance()
        self._hello: dict[str, dict] = {}          # peer address -> its layout, after a handshake that matched
        self._lock = threading.Lock()
        self._local = threading.local()            # .socks: peer address -> this thread's DEALER socket

    def _socket(self, address: str):
        socks = self._local.__dict__.setdefault("socks", {})
        sock = socks.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(address)
            socks[address] = sock
        return sock

    def _forget(self, address: str) -> None:
        sock = self._local.__dict__.get("socks", {}).pop(address, None)
        if sock is not None:
            sock.close(0)

    def _call(self, address: str, msg: dict) -> tuple[dict, list]:
        deadline = time.monotonic() + self.timeout
        late = TransportError(f"the context server's transport {address} did not answer {msg.get('op')} within "
                              f"{self.timeout:g} s (it may have died)")
        sock = self._socket(address)
        try:
            if not sock.poll(0, zmq.POLLOUT):          # no live connection: is anything listening there?
                host, port = address.split("://", 1)[1].rsplit(":", 1)
                try:
                    socket.create_connection((host.strip("[]"), int(port)), timeout=min(self.timeout, 5.0)).close()
                except OSError as e:
                    raise TransportError(f"the context server's transport {address} is not listening "
                                         f"({e.strerror or e}); it may have died") from None
                if not sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
                    raise late
            sock.send(json.dumps(msg).encode())
            if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise late
            head, *payload = sock.recv_multipart(copy=False)
            reply = json.loads(head.bytes)
        except BaseException:
            self._forget(address)
            raise
        if not reply.get("ok"):
            raise TransportError(f"the context server's transport {address} refused {msg.get('op')}: "
                                 f"{reply.get('error')}")
        return reply, payload

    def knows(self, address: str) -> bool:
        """Whether a handshake with `address` matched already (then `handshake` has nothing to do)."""
        with self._lock:
            return address in self._hello

    def handshake(self, address: str, layout: dict) -> None:
        """Compare layouts with the peer once per address (both sides compare; the refusal names the first
        difference)."""
        with self._lock:
            if address in self._hello:
                return
        sock_reply = None
        try:
            sock_reply, _ = self._call(address, {"op": "hello", "layout": layout})
        except TransportError as e:
            if "refused hello" in str(e):
                from kestrel.disagg.handshake import LayoutMismatch
                raise LayoutMismatch(f"cache layouts differ: {str(e).split('refused hello: ', 1)[1]}; start both "
                                     "servers with the same model, --dtype, --page-size, drafter and parallel "
                                     "layout") from None
            raise
        with self._lock:
            self._hello[address] = sock_reply["layout"]

    def pull(self, address: str, tid: str, method: str = "zmq", device: str = "cpu") -> PackedState:
        """The state's bytes, in host memory (or, over NIXL, in `device` memory)."""
        if method == "nixl":
            return self._pull_nixl(address, tid, device)
        reply, payload = self._call(address, {"op": "pull", "tid": tid})
        buf = join_frames(reply, payload, f"the transfer {tid} from {address}", self.pin_memory)
        return PackedState(reply["manifest"], buf, reply["checksum"])

    def _pull_nixl(self, address: str, tid: str, device: str = "cpu") -> PackedState:
        agent = _Nixl.agent()
        reply, payload = self._call(address, {"op": "nixl", "tid": tid})
        with _Nixl.busy:
            return self._read_nixl(agent, address, tid, reply, bytes(payload[0].buffer), device)

    def _read_nixl(self, agent, address: str, tid: str, reply: dict, metadata: bytes, device: str) -> PackedState:
        remote = _Nixl.remote(metadata)
        buf = torch.empty(reply["nbytes"], dtype=torch.uint8, device=device)
        reg = agent.register_memory([buf])
        try:
            local = agent.get_xfer_descs([buf])
            far = agent.get_xfer_descs([(reply["addr"], reply["nbytes"], reply["device"])], reply["mem"])
            handle = agent.initialize_xfer("READ", local, far, remote)
            try:
                state = agent.transfer(handle)
                deadline = time.monotonic() + self.timeout
                while state not in ("DONE", "ERR"):
                    if time.monotonic() > deadline:
                        raise TransportError(f"the NIXL read of {tid} from {address} took over {self.timeout:g} s")
                    state = agent.check_xfer_state(handle)
                if state == "ERR":
                    raise TransportError(f"the NIXL read of {tid} from {address} failed")
            finally:
                agent.release_xfer_handle(handle)
        finally:
            agent.deregister_memory(reg)
        return PackedState(reply["manifest"], buf, reply["checksum"])

    def ack(self, address: str, tid: str) -> None:
        self._call(address, {"op": "ack", "tid": tid})
