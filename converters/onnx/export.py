"""Hugging Face checkpoint -> ONNX decoder with a KV cache, quantized, in a model folder.

Export uses optimum's exporter (task ``text-generation-with-past``). Quantization:
- int8: onnxruntime dynamic quantization (7-bit weights per channel, activations quantized at
  run time; the MLP's down projections and the first and last layer kept float; see
  ``_dynamic_int8``);
- int8wo: 8-bit weight-only MatMulNBits (activations stay float): close to fp32;
- int4: onnxruntime's MatMulNBits weight-only quantizer (block size, symmetry and accuracy
  level from ConvertConfig);
- fp16: weights and compute in float16 with float32 inputs and outputs (for GPU providers;
  on CPU it saves disk, not time).
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from edgeinfer.errors import ConversionError
from edgeinfer.files.manifest import Architecture, Manifest

from ..config import ConvertConfig
from ..sources.checkpoint import SourceCheckpoint
from ..sources.hf_config import ModelConfig, read_json_object, read_model_config, token_ids

__all__ = ["export_onnx", "quantize_onnx", "write_model_folder"]

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def export_onnx(checkpoint: Path, out: Path) -> Path:
    """Export ``checkpoint`` to ``out/model.onnx`` (fp32); return the graph's path."""
    from optimum.exporters.onnx import main_export

    try:
        main_export(
            str(checkpoint),
            output=str(out),
            task="text-generation-with-past",
            device="cpu",
            do_validation=False,
        )
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as exc:
        raise ConversionError(f"optimum could not export {checkpoint}: {exc}") from exc
    graph = out / "model.onnx"
    if not graph.is_file():
        raise ConversionError(f"optimum wrote no model.onnx into {out}")
    return graph


def quantize_onnx(graph: Path, out: Path, cfg: ConvertConfig) -> dict[str, Any]:
    """Write the ``cfg.quant`` version of ``graph`` to ``out``; return what was done."""
    if cfg.quant == "fp32":
        _save(_load(graph), out)
        return {"method": "fp32"}
    if cfg.quant == "int8":
        return _dynamic_int8(graph, out)
    if cfg.quant in ("int4", "int8wo"):
        return _nbits(graph, out, cfg, bits=4 if cfg.quant == "int4" else 8)
    return _fp16(graph, out)


def _dynamic_int8(graph: Path, out: Path) -> dict[str, Any]:
    """onnxruntime's dynamic quantization, with two departures from its defaults that the
    default model needs on x86 CPUs without VNNI (AVX2 only), where MatMulInteger multiplies
    uint8 activations by int8 weights in pairs summed into int16, which saturates:
    - weights in 7 bits (``reduce_range``), so a pair's sum (2 x 255 x 63) fits in int16;
    - the MLP's down projections stay float: their inputs (after the gated activation) hold
      outliers that a per-tensor uint8 activation scale crushes everything else under; so do
      every projection of the first and the last layer, where the error costs most.
    With onnxruntime's defaults the default model's int8 folder agreed 0-1.6% top-1 with its
    source on an AVX2 machine (issue 28); each departure alone was not enough there."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(graph), load_external_data=False).graph
    weights = {t.name for t in model.initializer}
    kept = _float_matmuls(
        [n.name for n in model.node if n.op_type == "MatMul" and n.input[1] in weights]
    )
    quantize_dynamic(
        graph,
        out,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
        reduce_range=True,
        weight_type=QuantType.QInt8,
        nodes_to_exclude=kept,
        use_external_data_format=True,  # weights beside the graph, as _save writes them
    )
    return {
        "method": "int8",
        "scheme": "dynamic, per-channel 7-bit QInt8 MatMul weights (reduce_range); "
        f"{len(kept)} MatMuls kept float (MLP down projections, first and last layer)",
    }


def _float_matmuls(names: list[str]) -> list[str]:
    """The MatMuls of optimum's graph (``/model/layers.N/...``) ``_dynamic_int8`` keeps float:
    every ``down_proj``, and every MatMul of the first and the last layer."""
    layers = {name: re.search(r"layers\.(\d+)/", name) for name in names}
    found = [int(m.group(1)) for m in layers.values() if m]
    edges = {str(min(found)), str(max(found))} if found else set()
    return [
        name
        for name, m in layers.items()
        if "down_proj" in name or (m is not None and m.group(1) in edges)
    ]


def _nbits(graph: Path, out: Path, cfg: ConvertConfig, *, bits: int) -> dict[str, Any]:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        _load(graph),
        bits=bits,
        block_size=cfg.int4_block_size,
        is_symmetric=cfg.int4_symmetric,
        accuracy_level=cfg.int4_accuracy_level,
    )
    quantizer.process()
    _save(quantizer.model.model, out)
    return {
        "method": cfg.quant,
        "scheme": f"MatMulNBits {bits}-bit weight-only",
        "block_size": cfg.int4_block_size,
        "symmetric": cfg.int4_symmetric,
        "accuracy_level": cfg.int4_accuracy_level,
    }


def _fp16(graph: Path, out: Path) -> dict[str, Any]:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(_load(graph), keep_io_types=True)
    _save(model, out)
    return {"method": "fp16", "scheme": "float16 weights and compute, float32 inputs/outputs"}


def _load(graph: Path) -> Any:
    import onnx

    return onnx.load(str(graph))


def _save(model: Any, out: Path) -> None:
    """Write the graph with its weights in ``<name>.data`` beside it, whatever the size:
    onnxruntime maps an external data file into memory instead of reading the protobuf and
    copying every initializer out of it, which halves peak memory at load (measured on the
    default model's int8 conversion: 517 -> 301 MB peak RSS)."""
    import onnx

    onnx.save_model(
        model,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out.name + ".data",
        size_threshold=1024,
    )


def write_model_folder(
    export_dir: Path, folder: Path, source: SourceCheckpoint, quantization: dict[str, Any]
) -> Manifest:
    """Copy the tokenizer and configs next to the graph and write the manifest."""
    for name in _TOKENIZER_FILES:
        if (export_dir / name).is_file():
            shutil.copy2(export_dir / name, folder / name)
    hp = read_model_config(export_dir / "config.json")
    generation = read_json_object(export_dir / "generation_config.json", required=False)
    tok_config = read_json_object(export_dir / "tokenizer_config.json", required=False)
    eos_ids = token_ids(export_dir / "generation_config.json", generation, "eos_token_id")
    manifest = Manifest(
        format="onnx",
        model_file="model.onnx",
        architecture=_architecture(hp),
        chat_template_file="chat_template.jinja"
        if (folder / "chat_template.jinja").is_file()
        else None,
        bos_token=_token_text(tok_config.get("bos_token")),
        eos_token=_token_text(tok_config.get("eos_token")),
        eos_token_ids=eos_ids if "eos_token_id" in generation else hp.eos_token_ids,
        source={"kind": source.kind, "path": str(source.path), "sha256": source.sha256},
        quantization=quantization,
    )
    template = tok_config.get("chat_template")
    if manifest.chat_template_file is None and isinstance(template, str) and template:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
        manifest = Manifest(**{**manifest.__dict__, "chat_template_file": "chat_template.jinja"})
    manifest.write(folder)
    return manifest


def _architecture(hp: ModelConfig) -> Architecture:
    return Architecture(
        model_type=hp.model_type,
        num_layers=hp.num_hidden_layers,
        num_kv_heads=hp.num_key_value_heads,
        head_dim=hp.head_dim,
        hidden_size=hp.hidden_size,
        max_context=hp.max_position_embeddings,
        vocab_size=hp.vocab_size,
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None
