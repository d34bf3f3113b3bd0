"""``edgeinfer serve``: the model behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from ..errors import BackendUnavailableError, InvalidRequestError
from ..serve.config import ServerConfig
from ..serve.guard import allowed_hosts, check_api_key
from .common import add_model_flags, load_model, parse_parallel

__all__ = ["add_parser", "cmd_serve"]

logger = logging.getLogger("edgeinfer.serve")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over OpenAI's HTTP API (chat and completions, streamed or not)",
        description="Serve MODEL (default: the catalog's default model) at "
        "http://HOST:PORT/v1 with OpenAI's wire format: POST /v1/chat/completions, POST "
        "/v1/completions, GET /v1/models, and GET /health. One model; up to --parallel "
        "requests run at once (batched into one forward pass per token), the rest wait in "
        "arrival order, and past --max-queue waiting ones a request gets 503 with "
        "Retry-After. Loopback only unless --api-key is set. Needs edgeinfer[serve].",
    )
    p.add_argument("model", nargs="?", metavar="MODEL", help="catalog name, .gguf or folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("EDGEINFER_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (default: $EDGEINFER_API_KEY; required to "
        "bind an address other than loopback)",
    )
    _add_request_flags(p)
    add_model_flags(p)


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """Which requests are answered, how many run and wait, how large, and how they are
    logged."""
    p.add_argument(
        "--parallel",
        default="1",
        metavar="N|auto",
        help="requests generated at once: the model gets N sequence slots sharing its "
        "weights and one KV allocation, and their tokens go through one forward pass per "
        "step; 'auto' takes as many as the memory budget holds (default: 1)",
    )
    p.add_argument(
        "--prompt-cache",
        metavar="DIR",
        help="keep the KV of long prompts (256 tokens or more read) in DIR and read a "
        "prompt's cached prefix back instead of computing it, across restarts (default: off)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=8,
        metavar="N",
        help="requests that may wait for a free slot; more get 503 (default: 8)",
    )
    p.add_argument(
        "--cors-origin",
        metavar="ORIGIN",
        help="allow browser requests from this origin, e.g. http://localhost:3000 (default: "
        "none: a request from any web page is refused with 403)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests that reach this server by NAME (their Host header); "
        "repeatable. By default only localhost, loopback addresses and the --host address "
        "are answered, so a web page cannot reach the server through a DNS name of its own",
    )
    p.add_argument(
        "--max-body-kb",
        type=int,
        default=4096,
        metavar="KB",
        help="largest request body accepted (default: 4096)",
    )
    p.add_argument(
        "--log-json", action="store_true", help="one JSON object per request line on stderr"
    )
    _add_client_flags(p)


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    """What a request that leaves fields out, or names another model, gets."""
    p.add_argument(
        "--sampling-defaults",
        choices=("edgeinfer", "openai"),
        default="edgeinfer",
        help="sampling for the fields a request leaves out: edgeinfer's own (temperature 0.8, "
        "top_k 40, top_p 0.95; small models stay coherent) or OpenAI's (temperature 1, top_p "
        "1) (default: edgeinfer)",
    )
    p.add_argument(
        "--speculative",
        metavar="MODE",
        help='speculative decoding for requests that do not set their own "speculative" '
        "field: off, auto, lookup, lookup:N or draft:MODEL[:N] (with --parallel N > 1 a "
        "request drafts while it runs alone; plain decoding's tokens up to the engines' "
        "noise at near-ties, faster) (default: off)",
    )
    p.add_argument(
        "--any-model-name",
        action="store_true",
        help="answer requests naming any model (e.g. a client that always sends gpt-4o) with "
        "the served model; replies name the served model (default: 404 for another name)",
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(args: argparse.Namespace) -> None:
    args.parallel = parse_parallel(args.parallel)
    if not 1 <= args.port <= 65535:
        raise InvalidRequestError(f"--port {args.port} must be from 1 to 65535")
    if args.max_queue < 0:
        raise InvalidRequestError(f"--max-queue {args.max_queue} must be 0 or more")
    if args.max_body_kb < 1:
        raise InvalidRequestError(f"--max-body-kb {args.max_body_kb} must be 1 or more")
    check_api_key(args.api_key, "--api-key (or $EDGEINFER_API_KEY)")
    allowed_hosts(args.host, args.allow_host)  # refuses a value that is not a host name
    if not _loopback(args.host) and not args.api_key:
        raise InvalidRequestError(
            f"--host {args.host} exposes the model beyond this machine; set --api-key KEY (or "
            "$EDGEINFER_API_KEY) so only clients with the key can use it, or bind 127.0.0.1"
        )
    try:
        with socket.socket(_family(args.host), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; choose another "
            "--port or stop what uses it"
        ) from exc


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as exc:
        raise BackendUnavailableError(
            "edgeinfer serve needs the server extra: pip install 'edgeinfer[serve]'"
        ) from exc
    from ..files import catalog
    from ..serve.app import create_app

    check_settings(args)
    args.model = args.model or catalog.DEFAULT_MODEL
    _log_access_to_stderr()
    with load_model(args, args.parallel) as model:
        name = args.model if isinstance(args.model, str) else str(args.model)
        app = create_app(model, _config(args, name))
        slots = getattr(model, "parallel", 1)
        print(
            f"edgeinfer: serving {name} at http://{args.host}:{args.port}/v1 "
            f"({model.info.get('provider')}, context {model.context_length}"
            f"{f', {slots} slots' if slots != 1 else ''})",
            file=sys.stderr,
            flush=True,
        )
        _server(uvicorn, app, args.host, args.port).run()
        if not app.state.wait_idle(timeout=30):  # generation threads still hold the model
            logger.warning("requests still running after 30 s; exiting without closing")
            os._exit(1)
    _ignore_stop_signals()  # the process is on its way out: a late signal must not kill it
    return 0


def _log_access_to_stderr() -> None:
    """The access log, one bare line per request, on stderr and nowhere else."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("edgeinfer.serve.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def _config(args: argparse.Namespace, name: str) -> ServerConfig:
    return ServerConfig(
        name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_kb * 1024,
        cors_origin=args.cors_origin,
        log_json=args.log_json,
        host=args.host,
        allow_hosts=tuple(args.allow_host),
        sampling_defaults=args.sampling_defaults,
        any_model_name=args.any_model_name,
    )


def _ignore_stop_signals() -> None:
    """Python resets handlers it installed to the default at exit (so a late SIGTERM would
    end the process with -15 instead of 0), but keeps SIG_IGN."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def _server(uvicorn: Any, app: Any, host: str, port: int) -> Any:
    """uvicorn's server, stopping the way a service should: the first SIGTERM or SIGINT ends
    every request in flight at once (streams get a final event, waiting requests 503) and
    logs one line; a repeated signal changes nothing (no forced exit mid-teardown), and the
    process exits 0 instead of re-raising the signal."""

    class Server(uvicorn.Server):  # type: ignore[misc, name-defined]
        def handle_exit(self, sig: int, frame: Any) -> None:
            self.should_exit = True  # uvicorn's main loop notices within 0.1 s

        async def shutdown(self, sockets: Any = None) -> None:
            running, waiting = app.state.shutdown()
            print(
                f"edgeinfer: shutting down: {running} running request(s) ended, "
                f"{waiting} waiting request(s) answered 503",
                file=sys.stderr,
                flush=True,
            )
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = Server(config)
    if threading.current_thread() is threading.main_thread():
        # uvicorn puts these handlers back when it stops, so a signal during the startup or
        # the model's teardown only sets a flag: nothing interrupts closing the engine
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)
    return server
