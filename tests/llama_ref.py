"""llama-cpp-python's own ``Llama`` as a reference, with the engine settings edgeinfer's policy
picks for this machine's CPU (so both sides run the same kernels, and neither runs the ones
the policy turned off because they crash)."""

from __future__ import annotations

from typing import Any
from unittest import mock

from edgeinfer.inventory import devices
from edgeinfer.policy import plan_providers


def reference_llama(path: str, **kwargs: Any) -> Any:
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    options = plan_providers(devices(engines=("llama_cpp",)), "gguf", "cpu").candidates[0].options
    default_params = bindings.llama_model_default_params

    def params() -> Any:
        made = default_params()
        if "use_extra_bufts" in options:
            made.use_extra_bufts = bool(options["use_extra_bufts"])
        return made

    with mock.patch.object(bindings, "llama_model_default_params", params):
        return Llama(path, **kwargs)
