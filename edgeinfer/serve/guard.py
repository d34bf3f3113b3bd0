"""Who may talk to the server: the ``Host`` and ``Origin`` a request names, and its API key.

A web page the user visits can send requests to a loopback server, and with DNS rebinding
(its own name re-pointed at 127.0.0.1) it can read the replies too. The browser then sends
the page's name as ``Host``, and a cross-site request carries the page's ``Origin``. So every
request must name this server as its ``Host`` (a loopback address or ``localhost``, the bound
address, or a name given with ``--allow-host``) and carry no ``Origin`` other than its own or
the one ``--cors-origin`` names; anything else is refused with 403 before any route runs.
An IP address cannot be rebound, so on a wildcard bind (0.0.0.0, which needs a key) any IP
address is a valid ``Host``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["HostGuard", "allowed_hosts", "check_api_key", "host_name", "key_matches"]

ANY = "*"  # --allow-host '*': every Host (behind a reverse proxy that checks it)


def host_name(value: str) -> str | None:
    """The name in a ``Host`` value (``name``, ``name:port``, ``[v6]:port``), lower case and
    without a trailing dot; None when the value is not a host at all."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end], value[end + 1 :]
        if end < 0 or not _is_ip(name, version=6):
            return None
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if rest and (rest[0] != ":" or not _is_port(rest[1:])):
        return None
    name = name[:-1] if name.endswith(".") else name
    if not name or not all(c.isascii() and (c.isalnum() or c in "-._:") for c in name):
        return None
    return name


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5 and 0 < int(text) <= 65535


def _is_ip(name: str, version: int | None = None) -> bool:
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return version is None or address.version == version


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a request may give as its Host: loopback, the bound address, ``extra``."""
    names = {"localhost", "127.0.0.1", "::1"}
    for value in (bound, *extra):
        value = value.strip().lower()
        if value == ANY:
            names.add(ANY)
            continue
        name = host_name(f"[{value}]" if _is_ip(value, version=6) else value)
        if name is None:
            raise InvalidRequestError(
                f"--allow-host {value!r} is not a host name or address; give a name such as "
                "mybox.local or an address such as 192.168.1.5"
            )
        names.add(name)
    return frozenset(names)


def _host_ok(name: str, allowed: frozenset[str]) -> bool:
    if ANY in allowed or name in allowed or name.endswith(".localhost"):
        return True
    if not _is_ip(name):
        return False
    address = ipaddress.ip_address(name)
    # a wildcard bind answers on every address of the machine, and no address can be rebound
    return address.is_loopback or "0.0.0.0" in allowed or "::" in allowed


def _origin_ok(origin: str, host: str, cors_origin: str | None) -> bool:
    origin = origin.strip().lower()
    if cors_origin is not None and origin == cors_origin.strip().lower().rstrip("/"):
        return True
    scheme, sep, rest = origin.partition("://")
    return bool(sep) and scheme in ("http", "https") and rest == host.strip().lower()


class HostGuard:
    """ASGI middleware refusing requests whose Host or Origin is not this server's."""

    def __init__(
        self,
        app: Any,
        *,
        hosts: frozenset[str],
        cors_origin: str | None,
        log: Callable[[dict[str, Any], int], None],
    ) -> None:
        self.app, self.hosts, self.cors_origin, self.log = app, hosts, cors_origin, log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(dict(scope.get("headers") or ()))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        code, message = refusal
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None}}
        body["error"]["code"] = code
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": 403, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        self.log({"method": scope.get("method"), "path": scope.get("path"), "status": 403}, 403)

    def refusal(self, headers: dict[bytes, bytes]) -> tuple[str, str] | None:
        """(code, message) when the request must be refused; None when it may pass."""
        raw_host = headers.get(b"host")
        host = raw_host.decode("latin-1") if raw_host is not None else None
        if host is not None:  # absent only outside browsers (HTTP/1.0 clients)
            name = host_name(host)
            if name is None or not _host_ok(name, self.hosts):
                shown = _shown(name or host)
                return "host_not_allowed", (
                    f"Host {shown} is not a name of this server; if clients reach it by that "
                    f"name, start the server with --allow-host {shown}"
                )
        raw_origin = headers.get(b"origin")
        if raw_origin is not None:
            origin = raw_origin.decode("latin-1")
            if not _origin_ok(origin, host or "", self.cors_origin):
                shown = _shown(origin)
                return "origin_not_allowed", (
                    f"requests from web pages at {shown} are not allowed; to allow one origin, "
                    f"start the server with --cors-origin {shown}"
                )
        return None


def _shown(value: str, limit: int = 60) -> str:
    text = value.encode("ascii", "backslashreplace").decode("ascii")
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


# -- API keys ---------------------------------------------------------------------------------


def key_bytes(key: str) -> bytes:
    """The key as the bytes a client sends: UTF-8 (argv and the environment hold undecodable
    bytes as surrogate escapes, which turn back into those bytes)."""
    return key.encode("utf-8", "surrogateescape")


def key_matches(header: str | None, key: bytes) -> bool:
    """Whether an ``Authorization`` header (as Starlette gives it: latin-1 decoded, so
    ``encode('latin-1')`` is the bytes as sent) carries ``Bearer KEY``."""
    if header is None:
        return False
    sent = header.encode("latin-1", "replace")
    if sent[:7].lower() != b"bearer ":
        return False
    return hmac.compare_digest(sent[7:].strip(b" \t"), key)


def check_api_key(key: str | None, where: str) -> None:
    """Refuse at start a key no client could ever send (empty, control characters, spaces at
    its ends), instead of locking every client out."""
    if key is None:
        return
    if not key.strip():
        raise InvalidRequestError(
            f"{where} is empty; give a key, or unset it to serve without one (loopback only)"
        )
    if key != key.strip(" \t") or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise InvalidRequestError(
            f"{where} has spaces at its ends or control characters, which no HTTP header can "
            "carry; choose a key of visible characters"
        )
