"""Folders in onnxruntime-genai's layout (genai_config.json + model.onnx + tokenizer) load
through edgeinfer's ONNX backend, with its memory plan and generator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import edgeinfer
from edgeinfer.errors import ModelLoadError
from edgeinfer.gguf_file import read_gguf_header

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def _genai_config(gguf: Path, *, share: bool = True) -> dict[str, object]:
    """genai_config.json as onnxruntime-genai's builder writes it (the keys it writes)."""
    meta = read_gguf_header(gguf).metadata
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    return {
        "model": {
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", 1),
            "context_length": meta[f"{arch}.context_length"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": hidden // heads,
                "hidden_size": hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": heads,
                "num_hidden_layers": meta[f"{arch}.block_count"],
                "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
            },
            "eos_token_id": [meta.get("tokenizer.ggml.eos_token_id", 2)],
            "type": arch,
            "vocab_size": len(meta["tokenizer.ggml.tokens"])
            if isinstance(meta["tokenizer.ggml.tokens"], list)
            else meta["tokenizer.ggml.tokens"].length,
        },
        "search": {"past_present_share_buffer": share, "max_length": 256},
    }


@pytest.fixture
def genai_folder(tiny_llama_gguf: Path, tmp_path: Path) -> Path:
    """A GroupQueryAttention graph with the tensor names genai graphs use, in genai's folder
    layout: no edgeinfer.json."""
    from edgeinfer.converters.native_pipeline import write_gguf_folder

    built = tmp_path / "built"
    built.mkdir()
    write_gguf_folder(tiny_llama_gguf, built, max_context=256)
    folder = tmp_path / "genai"
    folder.mkdir()
    for name in ("model.onnx", "model.onnx.data", "tokenizer.json"):
        shutil.copy2(built / name, folder / name)
    config = _genai_config(tiny_llama_gguf)
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_genai_folder_loads_and_generates_like_the_same_graph(
    genai_folder: Path, tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    from edgeinfer.converters.native_pipeline import write_gguf_folder

    ours = tmp_path / "ours"
    ours.mkdir()
    write_gguf_folder(tiny_llama_gguf, ours, max_context=256)
    with edgeinfer.load(genai_folder, context_length=128, threads=1) as model:
        assert model.info["quantization"] == "onnxruntime-genai"
        assert model.info["memory_plan"]["kv_factor"] == 1.0  # one shared cache buffer
        got = model.generate("Hello there", max_new_tokens=8, temperature=0)
    with edgeinfer.load(ours, context_length=128, threads=1) as model:
        want = model.generate("Hello there", max_new_tokens=8, temperature=0)
    assert got.token_ids == want.token_ids
    assert not (genai_folder / "edgeinfer.json").exists()  # nothing written into the folder


def test_genai_folder_with_other_tensor_names_is_refused(genai_folder: Path) -> None:
    config = json.loads((genai_folder / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    (genai_folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"past_key_names='past.%d.k'.*'past_key_values"):
        edgeinfer.load(genai_folder)


def test_damaged_genai_config_is_a_load_error(genai_folder: Path) -> None:
    (genai_folder / "genai_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"genai_config\.json"):
        edgeinfer.load(genai_folder)
    (genai_folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": []}}))
    with pytest.raises(ModelLoadError, match=r"model\.decoder must be a JSON object"):
        edgeinfer.load(genai_folder)
