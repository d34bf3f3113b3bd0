"""The folder's size: the embedding of every transcodable block type is kept as blocks
(GatherBlockQuantized, plus a gathered offset per 32 for the types with a minimum) instead of
a float32 table, and gives the same logits to the bit; ``FORMS`` (what the builder decides
before reading a tensor) is what ``transcode`` returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeinfer.converters.onnx.builder import build_onnx_from_gguf, parts
from edgeinfer.converters.onnx.builder.gguf_blocks import FORMS, transcode

from .ggufgen import Tensor, tiny_llama

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")
T = gguf.GGMLQuantizationType
Q8_0 = 8


@pytest.mark.parametrize("qtype", sorted(FORMS), ids=lambda t: T(t).name)
def test_forms_are_what_transcode_returns(qtype: int) -> None:
    from .test_gguf_blocks import random_tensor

    w = transcode(qtype, random_tensor(qtype, 4, 256), 4, 256)
    assert w is not None
    form = FORMS[qtype]
    assert (w.bits, w.block_size, w.offset is not None) == (form.bits, form.block_size, form.offset)


def _model(embedding_type: int, folder: Path) -> Path:
    """A one-layer Llama, untied: its embedding of ``embedding_type``, the rest Q8_0."""
    from .test_gguf_blocks import random_tensor

    model = tiny_llama(hidden=256, ffn=512, layers=1)
    vocab = model.tensors[0].shape[1]
    model.tensors.append(Tensor("output.weight", (256, vocab), b""))
    blocks = []
    for i, t in enumerate(model.tensors):
        if len(t.shape) != 2:
            blocks.append(t)
            continue
        qtype = embedding_type if t.name == "token_embd.weight" else Q8_0
        raw = random_tensor(qtype, t.shape[1], t.shape[0], seed=i)
        blocks.append(Tensor(t.name, t.shape, raw.tobytes(), qtype))
    model.tensors = blocks
    return model.write(folder / f"embd-{embedding_type}.gguf")


def _logits(folder: Path, ids: list[int]) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(folder / "model.onnx"), options)
    feed = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "num_logits_to_keep": np.array([len(ids)], np.int64),
    }
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feed[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return session.run(["logits"], feed)[0]


@pytest.mark.parametrize("qtype", sorted(FORMS), ids=lambda t: T(t).name)
def test_gathered_embedding_blocks_are_the_float_table_to_the_bit(
    qtype: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _model(qtype, tmp_path)
    built = {}
    for kind in ("table", "blocks"):
        if kind == "table":
            monkeypatch.setattr(parts, "_GATHERED", frozenset())
        else:
            monkeypatch.undo()
        out = tmp_path / kind
        out.mkdir()
        build_onnx_from_gguf(src, out, max_context=64)
        built[kind] = (_logits(out, list(range(0, 260, 7))), (out / "model.onnx.data").stat())
    np.testing.assert_array_equal(built["blocks"][0], built["table"][0])
    assert built["blocks"][1].st_size < built["table"][1].st_size
