"""llama-cpp-python's own ``Llama`` as a reference, with the engine settings edgeinfer's policy
picks for this machine's CPU (the same constructor ``edgeinfer bench --compare`` uses)."""

from __future__ import annotations

from typing import Any

from edgeinfer.bench.peers import policy_llama


def reference_llama(path: str, **kwargs: Any) -> Any:
    return policy_llama(path, **kwargs)
