"""The peers ``edgeinfer bench --compare`` runs beside edgeinfer, and how to find them.

A peer runs the same workload on its own terms: llama-cpp-python on a GGUF file, optimum's
``ORTModelForCausalLM`` on an ONNX folder that keeps its ``config.json``, onnxruntime-genai on
a folder its model builder made (``genai_config.json``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["INSTALL_HINTS", "Peer", "as_named", "peer_kind", "peers_for", "policy_llama"]

# what to install for each peer
INSTALL_HINTS = {
    "llama-cpp-python": "pip install 'edgeinfer[gguf]' (llama-cpp-python)",
    "optimum": "pip install 'edgeinfer[convert]' (optimum, optimum-onnx, torch)",
    "onnxruntime-genai": "pip install onnxruntime-genai",
}
_MODULES = {
    "llama-cpp-python": ("llama_cpp",),
    "optimum": ("optimum.onnxruntime", "torch", "transformers"),
    "onnxruntime-genai": ("onnxruntime_genai",),
}


@dataclass(frozen=True)
class Peer:
    engine: str  # a key of INSTALL_HINTS
    path: Path  # the file or folder the peer loads


def as_named(given: str, path: Path) -> str:
    """What edgeinfer's run loads: a catalog name as named (``load()`` routes a catalog
    GGUF by its name: ``--engine``, ``--parallel``), anything else by its resolved path."""
    from ..files import catalog

    named = catalog.lookup(given) is not None and not Path(given).expanduser().exists()
    return given if named else str(path)


def installed(engine: str) -> bool:
    """Whether the peer's packages can be imported here (looked up, not imported)."""
    for name in _MODULES[engine]:
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):  # a parent package missing
            return False
    return True


def peer_kind(path: Path) -> str | None:
    """Which peer runs this file or folder, or None when none does."""
    if path.is_file():
        return "llama-cpp-python" if path.suffix.lower() == ".gguf" else None
    if not path.is_dir():
        return None
    if (path / "genai_config.json").is_file():
        return "onnxruntime-genai"
    if (path / "config.json").is_file() and any(path.glob("*.onnx")) and not _shared_kv(path):
        return "optimum"
    return None


def _shared_kv(folder: Path) -> bool:
    """A graph with a shared KV cache (GroupQueryAttention): optimum cannot run it."""
    from ..errors import ModelLoadError
    from ..files.manifest import MANIFEST_NAME, Manifest

    if not (folder / MANIFEST_NAME).is_file():
        return False
    try:
        return Manifest.read(folder).architecture.kv_cache == "shared"
    except ModelLoadError:
        return False


def peers_for(
    model_path: Path, model_format: str, peer_models: tuple[str, ...] = ()
) -> tuple[list[Peer], list[str]]:
    """The peers to run beside edgeinfer on ``model_path`` and the lines explaining the ones
    skipped. A peer runs our file when it can; a file or folder in ``peer_models`` adds its
    peer, or replaces our file for that peer."""
    wanted: list[Peer] = []
    if model_format == "gguf":
        wanted.append(Peer("llama-cpp-python", model_path))
    else:
        kind = peer_kind(model_path)
        if kind is not None:
            wanted.append(Peer(kind, model_path))
    for text in peer_models:
        path = Path(text).expanduser()
        if not path.exists():
            raise InvalidRequestError(f"--peer-model {text}: no such file or folder")
        kind = peer_kind(path)
        if kind is None:
            raise InvalidRequestError(
                f"--peer-model {text}: not a model a peer runs (a .gguf file for "
                "llama-cpp-python, a folder with genai_config.json for onnxruntime-genai, "
                "or a folder with config.json and an .onnx file for optimum)"
            )
        # the peer's own model takes the place of ours for that peer
        wanted = [p for p in wanted if p.engine != kind] + [Peer(kind, path)]
    peers: list[Peer] = []
    skipped: list[str] = []
    for peer in wanted:
        if installed(peer.engine):
            peers.append(peer)
        else:
            skipped.append(
                f"skipping {peer.engine}: not installed here; add it with "
                f"{INSTALL_HINTS[peer.engine]}"
            )
    if not wanted:
        skipped.append(
            f"no peer runs {model_path.name} as it is; name one with --peer-model (a .gguf "
            "file, an optimum export or an onnxruntime-genai folder of the same model)"
        )
    return peers, skipped


def policy_llama(path: str, **kwargs: Any) -> Any:
    """llama-cpp-python's ``Llama`` with the engine settings edgeinfer's policy picks for
    this machine's CPU, so both run the same kernels, and neither the ones the policy turned
    off because they crash (llama.cpp's AMX weight repacking)."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    from ..machine.inventory import devices
    from ..machine.policy import plan_providers

    options = plan_providers(devices(engines=("llama_cpp",)), "gguf", "cpu").candidates[0].options
    default_params = bindings.llama_model_default_params

    def params() -> Any:
        made = default_params()
        if "use_extra_bufts" in options:
            made.use_extra_bufts = bool(options["use_extra_bufts"])
        return made

    # Llama() builds its model parameters from this function and takes no option for them
    bindings.llama_model_default_params = params
    try:
        return Llama(path, **kwargs)
    finally:
        bindings.llama_model_default_params = default_params
