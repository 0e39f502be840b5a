"""Who may talk to the server: API keys (several, compared in constant time) and the Host header check that keeps
a web page from reaching a loopback server through DNS rebinding."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def check_bearer(header: bytes | None, keys: tuple[bytes, ...]) -> str | None:
    """None when `Authorization: Bearer <key>` names one of `keys` (the scheme in any case), else why not. Every
    key is compared, each in constant time, so the answer's timing says nothing about which key came close."""
    if header is None:
        return "no API key given: send the header `Authorization: Bearer <key>`"
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        return "the Authorization header must be `Bearer <key>`"
    token = token.strip()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return None if ok else "incorrect API key given: send a key this server was started with (--api-key)"


def host_of(header: bytes) -> str:
    """The host part of a Host header value, lower case: `[::1]:8000` -> `::1`, `Example.com.:80` -> `example.com`."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class HostCheck:
    """The Host header values this server answers to. A page on another site that rebinds its own name to this
    machine's address still sends its own name as Host, so it is refused."""
    names: frozenset[str]
    any_ip: bool = False        # a wildcard bind answers on every address: any IP literal is this server

    @classmethod
    def for_bind(cls, host: str, bound: str, extra: list[str] = ()) -> "HostCheck | None":
        """The check for a server started with `--host host` and bound to the address `bound`; `extra` are the
        --allowed-hosts names (`*` turns the check off: None)."""
        extra = [h.strip().lower().rstrip(".") for h in extra if h.strip()]
        if "*" in extra:
            return None
        names = {host.strip("[]").lower().rstrip("."), bound.lower(), *extra}
        any_ip = False
        try:
            addr = ipaddress.ip_address(bound)
        except ValueError:
            addr = None
        if addr is not None and addr.is_unspecified:
            any_ip = True
            names |= LOOPBACK_NAMES
            hostname = socket.gethostname().lower()
            names |= {hostname, hostname.split(".")[0]}
        elif addr is not None and addr.is_loopback:
            names |= LOOPBACK_NAMES
        return cls(frozenset(names), any_ip)

    def refuse(self, values: list[bytes]) -> str | None:
        """None when the request's Host header values are one of this server's names, else why not."""
        if len(values) != 1:
            return (f"the request has {len(values)} Host headers; send exactly one" if values else
                    "the request has no Host header; send one naming this server")
        name = host_of(values[0])
        if name in self.names or (self.any_ip and _is_ip(name)):
            return None
        shown = values[0].decode("latin-1")[:80]
        return (f"the Host header `{shown}` does not name this server; use its address, or start the server with "
                f"`--allowed-hosts {name}` if that name is yours")
