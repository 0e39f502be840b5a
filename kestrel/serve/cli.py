"""`kestrel serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from kestrel.errors import KestrelError

log = logging.getLogger("kestrel.serve")


def register(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                          "/metrics over HTTP.")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port; default 8000)")
    g.add_argument("--api-key", default=os.environ.get("KESTREL_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $KESTREL_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the checkpoint directory's name)")
    g.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    p.set_defaults(func=cmd_serve)


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

    sock = bind(args.host, args.port)
    engine = build_engine(engine_config(args))
    app = create_app(engine, served_model_name=args.served_model_name, api_key=args.api_key)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s at http://%s:%d/v1 (max_model_len %d%s)", app.server.model_name, shown, port,
             engine.max_model_len, ", API key required" if args.api_key else "")
    quiet = logging.getLogger().level > logging.INFO
    config = uvicorn.Config(app, log_level="warning" if quiet else "info", access_log=not args.no_access_log,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
