"""The server's settings, fixed when it starts (``edgeinfer serve``'s flags)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerConfig"]


@dataclass(frozen=True)
class ServerConfig:
    name: str  # the model id clients name
    api_key: str | None = None
    max_queue: int = 8  # requests waiting for the model beyond the one it serves
    max_body_bytes: int = 4 * 2**20
    cors_origin: str | None = None
    log_json: bool = False
    retry_after_s: int = 2
    host: str = "127.0.0.1"  # the bound address: a name requests may give as their Host
    allow_hosts: tuple[str, ...] = ()  # more such names (--allow-host)
    # the sampling a request's missing fields take: "edgeinfer" or "openai" (wire.py)
    sampling_defaults: str = "edgeinfer"
    # answer a request naming any model with the one served (replies name the served one)
    any_model_name: bool = False
