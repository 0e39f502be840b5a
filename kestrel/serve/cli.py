"""`kestrel serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket

from kestrel.errors import KestrelError

log = logging.getLogger("kestrel.serve")

DEFAULT_HOST = "127.0.0.1"


def register(subparsers, add_engine_args) -> None:
    from kestrel.serve.chat_format import CHAT_FORMATS, PARSERS
    from kestrel.serve.protocol import Limits
    d = Limits()
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                          "/metrics and /openapi.json over HTTP.")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=None,
                   help=f"address to listen on (default {DEFAULT_HOST}; another address without an API key warns)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port; default 8000)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health; repeat for several keys "
                        "(default: $KESTREL_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="file with one accepted API key per line (blank lines and # comments skipped)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the checkpoint folder's name)")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="NAME[,NAME]",
                   help="more Host header names to answer to (the bound address is always one; `*` = any)")
    g.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    c = p.add_argument_group("chat")
    c.add_argument("--chat-format", default="auto", choices=CHAT_FORMATS,
                   help="how chat messages become prompt ids: kimi_k2 (Kimi K2 / Kimi Linear) or kimi_k3 encodings, "
                        "or the checkpoint's Jinja template (default auto: the template if the checkpoint has one, "
                        "else the family of the tokenizer's control tokens)")
    c.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help="parse tool calls out of chat outputs into message.tool_calls (default: the family of the "
                        "tokenizer's control tokens, if any)")
    c.add_argument("--reasoning-parser", default=None, choices=PARSERS,
                   help="return thinking as reasoning_content apart from content (default: as --tool-call-parser); "
                        "given explicitly, K2 prompts also open <think>")
    lim = p.add_argument_group("server limits (each refusal is a 4xx naming the limit)")
    lim.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help=f"largest request body, bytes (413 past it; default {d.max_request_bytes})")
    lim.add_argument("--max-choices", type=int, default=d.max_choices,
                     help=f"prompts x n per request, one engine request each (default {d.max_choices})")
    lim.add_argument("--max-stop", type=int, default=d.max_stop,
                     help=f"stop strings per request (default {d.max_stop})")
    lim.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                     help=f"characters of one stop string (default {d.max_stop_chars})")
    lim.add_argument("--max-request-tokens", type=int, default=d.max_request_tokens,
                     help="tokens one request may generate, max_tokens summed over its choices; a request that "
                          f"leaves max_tokens out gets its share (default {d.max_request_tokens})")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection may take to send a request's headers (default 10)")
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request may take to send its body (408 past it; default 30)")
    lim.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle keep-alive connection stays open (default 5)")
    lim.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="at SIGTERM, seconds in-flight requests get to finish before they are aborted (default 30)")
    dg = p.add_argument_group("disaggregated serving (README: Disaggregated serving)")
    dg.add_argument("--role", default="both", choices=["both", "context", "generation", "frontend"],
                    help="both: prefill and decode in this server (default); context: run prompts and hand their "
                         "cache state to a generation server; generation: decode states handed over; frontend: "
                         "the OpenAI API in front of them (loads no model)")
    dg.add_argument("--discovery-dir", default=None, metavar="DIR",
                    help="shared directory where every server publishes itself (one YAML file each); needed by "
                         "the context, generation and frontend roles")
    dg.add_argument("--kv-transport", default="auto", choices=["auto", "zmq", "nixl"],
                    help="how a generation server pulls states: NIXL where it imports on both sides (auto), or "
                         "ZMQ over TCP")
    dg.add_argument("--handoff-timeout", type=float, default=30.0,
                    help="seconds a context server keeps an exported state for its generation server, and a "
                         "generation server waits for a transfer (default 30)")
    dg.add_argument("--prefill-timeout", type=float, default=600.0,
                    help="frontend: seconds a context server may take to answer a request's prefill; past it the "
                         "server counts as dead and the request is retried once on another one (default 600)")
    p.set_defaults(func=cmd_serve)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every accepted key from --api-key (repeated), --api-key-file and $KESTREL_API_KEY; an empty key is an
    error, never silently "no authentication"."""
    keys: list[str] = []
    given = args.api_key
    source = "--api-key"
    if given is None and args.api_key_file is None and "KESTREL_API_KEY" in os.environ:
        given, source = [os.environ["KESTREL_API_KEY"]], "$KESTREL_API_KEY"
    for k in given or []:
        if not k.strip():
            raise KestrelError(f"{source} is empty: give a key, or leave it out to serve without authentication")
        keys.append(k.strip())
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as e:
            raise KestrelError(f"--api-key-file {args.api_key_file}: cannot read it ({e}); give a readable text file")
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise KestrelError(f"--api-key-file {args.api_key_file} has no keys; put one key per line")
        keys += file_keys
    if any(any(c.isspace() for c in k) for k in keys):
        raise KestrelError("an API key contains whitespace; a Bearer token cannot carry it, so pick another key")
    return tuple(dict.fromkeys(keys))


def check_flags(args: argparse.Namespace) -> None:
    """Every server flag, before any weights load."""
    for name in ("max_request_bytes", "max_choices", "max_stop", "max_stop_chars", "max_request_tokens"):
        if getattr(args, name) < 1:
            raise KestrelError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        v = getattr(args, name)
        if not v > 0 or v == float("inf"):
            raise KestrelError(f"--{name.replace('_', '-')} {v}: must be a number of seconds > 0")
    if not args.shutdown_timeout >= 0 or args.shutdown_timeout == float("inf"):
        raise KestrelError(f"--shutdown-timeout {args.shutdown_timeout}: must be a number of seconds >= 0")
    role = getattr(args, "role", "both")
    if role != "both" and not getattr(args, "discovery_dir", None):
        raise KestrelError(f"--role {role} needs --discovery-dir DIR: the directory where the servers of a "
                           "disaggregated deployment find each other")
    for name, default in (("handoff_timeout", 30.0), ("prefill_timeout", 600.0)):
        t = getattr(args, name, default)
        if not t > 0 or t == float("inf"):
            raise KestrelError(f"--{name.replace('_', '-')} {t}: must be a number of seconds > 0")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error and port 0 works."""
    if not 0 <= port <= 65535:
        raise KestrelError(f"--port {port}: not a port number; use 0..65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise KestrelError(f"--host {host}: cannot resolve it ({e.strerror}); use an IP address or a known name")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise KestrelError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port "
                           "or stop the process that uses it")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from kestrel.cli import engine_config
    from kestrel.llm import build_engine
    from kestrel.serve.api import create_app
    from kestrel.serve.lifecycle import GracefulServer, header_timeout_protocol
    from kestrel.serve.protocol import Limits
    from kestrel.serve.security import HostCheck

    check_flags(args)
    if int(os.environ.get("RANK", "0")) != 0:
        # a follower rank of a layout over several ranks (kestrel/parallel): no socket, no app; it runs rank 0's
        # steps and its process exits inside build_engine when rank 0 stops
        build_engine(engine_config(args))
        return 0
    keys = api_keys(args)
    host = args.host if args.host is not None else DEFAULT_HOST
    if not keys and not is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model; "
                    "give --api-key or --api-key-file", host)
    limits = Limits(args.max_request_bytes, args.max_choices, args.max_stop, args.max_stop_chars,
                    args.max_request_tokens)
    sock = bind(host, args.port)
    bound, port = sock.getsockname()[:2]
    hosts = HostCheck.for_bind(host, bound, [h for v in args.allowed_hosts for h in v.split(",")])
    if args.role == "frontend":
        return _serve_frontend(args, sock, keys, hosts)
    engine = build_engine(engine_config(args))
    app = create_app(engine, served_model_name=args.served_model_name, api_keys=keys, limits=limits, hosts=hosts,
                     body_timeout=args.body_timeout, chat_format=args.chat_format,
                     tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    shown = f"[{bound}]" if ":" in bound else bound
    if app.server.chat is not None:
        log.info("%s", app.server.chat.describe())
    log.info("serving %s at http://%s:%d/v1 (max_model_len %d%s)", app.server.model_name, shown, port,
             engine.max_model_len, ", API key required" if keys else "")
    quiet = logging.getLogger().level > logging.INFO
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not args.no_access_log,
                            http=header_timeout_protocol(args.header_timeout),
                            timeout_keep_alive=args.keep_alive_timeout, lifespan="off")
    worker = publisher = None
    if args.role in ("context", "generation") or args.discovery_dir:
        worker, publisher = _join_deployment(args, app.server, engine, _public_url(bound, port))
    try:
        GracefulServer(config, app.server, args.shutdown_timeout).run(sockets=[sock])
    finally:
        if publisher is not None:
            publisher.stop()
        if worker is not None:
            worker.stop()
    return 0


def _public_url(bound: str, port: int) -> str:
    """The URL other servers reach this one at (a wildcard bind publishes this host's address)."""
    if bound in ("0.0.0.0", "::"):
        bound = socket.gethostbyname(socket.gethostname())
    return f"http://[{bound}]:{port}" if ":" in bound else f"http://{bound}:{port}"


def _join_deployment(args, server, engine, url: str):
    """A context or generation server: its disaggregation routes and state transport, and its discovery entry
    (checked on its own side: a peer's layout is compared at the handshake)."""
    from kestrel.disagg.discovery import Entry, Publisher
    from kestrel.disagg.handshake import cache_layout, check_own
    from kestrel.disagg.worker import Worker
    from kestrel.parallel.mapping import Mapping
    m = Mapping.from_engine_config(engine.engine_config)
    layout = cache_layout(engine.cache, engine.config,
                          {"tp": m.tp, "dp": m.dp, "ep": m.ep, "cp": m.helix, "moe_tp": m.moe_tp})
    check_own(layout)
    host = url.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
    worker = Worker(server, args.role, layout, host=host, hold=args.handoff_timeout, timeout=args.handoff_timeout,
                    method=args.kv_transport)
    entry = Entry(url=url, role=args.role, model=server.model_name, cache_layout=layout,
                  parallel_layout=layout["parallel"], transport=worker.transport())
    publisher = Publisher(args.discovery_dir, entry).start()
    log.info("%s server published in %s (transport %s)", args.role, args.discovery_dir,
             worker.transport().get("zmq", "client"))
    return worker, publisher


def _serve_frontend(args, sock, keys, hosts) -> int:
    import uvicorn
    from kestrel.disagg.discovery import Entry, Publisher
    from kestrel.disagg.frontend import Frontend
    from kestrel.serve.lifecycle import header_timeout_protocol
    bound, port = sock.getsockname()[:2]
    url = _public_url(bound, port)
    front = Frontend(args.discovery_dir, url, keys, max_request_bytes=args.max_request_bytes, hosts=hosts,
                     prefill_timeout=args.prefill_timeout)
    publisher = Publisher(args.discovery_dir, Entry(url=url, role="frontend", model="")).start()
    log.info("serving frontend at %s/v1 (discovery %s)", url, args.discovery_dir)
    quiet = logging.getLogger().level > logging.INFO
    config = uvicorn.Config(front.app, log_level="warning" if quiet else "info", access_log=not args.no_access_log,
                            http=header_timeout_protocol(args.header_timeout),
                            timeout_keep_alive=args.keep_alive_timeout, lifespan="on")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        publisher.stop()
    return 0
