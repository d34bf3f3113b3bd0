"""GGUF blocks transcoded to MatMulNBits: every type dequantizes to what the ``gguf`` package
(llama.cpp's reference) dequantizes, and onnxruntime's own MatMulNBits kernel, with the
offset term beside it, multiplies by those values."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from edgeinfer.converters.onnx.builder.gguf_blocks import (
    FORMS,
    OFFSET_BLOCK,
    TRANSCODABLE,
    NBitsWeight,
    transcode,
    transcode_reads,
)
from edgeinfer.files.gguf_file import TensorInfo

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# type -> byte offsets of its fp16 fields (the rest of a block may hold any bits)
FP16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def random_tensor(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of ``qtype`` for an [n, k] weight: random bits, finite fp16 fields."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        values = rng.uniform(-0.05, 0.05, size=(n, k // elems)).astype(np.float16)
        raw[..., at : at + 2] = values[..., None].view(np.uint8).reshape(n, k // elems, 2)
    return raw.reshape(n, -1)


def test_the_table_covers_the_issue_types() -> None:
    names = {T(t).name for t in TRANSCODABLE}
    assert names == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS), ids=lambda t: T(t).name)
def test_dequantizes_as_llama_cpp_does(qtype: int) -> None:
    n, k = 24, 512
    raw = random_tensor(qtype, n, k)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    assert reference.shape == (n, k)
    weight = transcode(int(qtype), raw, n, k)
    assert weight is not None
    ours = weight.dequantize()
    scale = float(np.abs(reference).max())
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6 * scale)
    assert weight.bits in (4, 8) and weight.block_size in (16, 32)
    assert weight.packed.shape == (n, k // weight.block_size, weight.block_size * weight.bits // 8)


def _matmul_nbits_graph(weight: NBitsWeight, m: int) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(weight.packed, "B"),
        numpy_helper.from_array(weight.scales.reshape(-1), "scales"),
    ]
    inputs = ["A", "B", "scales"]  # zero points: MatMulNBits' default
    nodes = [
        helper.make_node(
            "MatMulNBits",
            inputs,
            ["Y0" if weight.offset is not None else "Y"],
            domain="com.microsoft",
            K=weight.k,
            N=weight.n,
            bits=weight.bits,
            block_size=weight.block_size,
            accuracy_level=0,
        )
    ]
    if weight.offset is not None:
        blocks = weight.k // OFFSET_BLOCK
        inits += [
            numpy_helper.from_array(np.array([m, blocks, OFFSET_BLOCK], np.int64), "shape3"),
            numpy_helper.from_array(np.array([-1], np.int64), "axes"),
            numpy_helper.from_array(weight.offset.T.copy(), "offsetT"),
        ]
        nodes += [
            helper.make_node("Reshape", ["A", "shape3"], ["A3"]),
            helper.make_node("ReduceSum", ["A3", "axes"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "offsetT"], ["Y1"]),
            helper.make_node("Add", ["Y0", "Y1"], ["Y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, weight.k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, weight.n])],
        initializer=inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS), ids=lambda t: T(t).name)
def test_onnxruntime_kernel_multiplies_by_the_gguf_values(qtype: int) -> None:
    ort = pytest.importorskip("onnxruntime")
    n, k, m = 40, 512, 3
    raw = random_tensor(qtype, n, k, seed=1)
    reference = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    weight = transcode(int(qtype), raw, n, k)
    assert weight is not None
    model = _matmul_nbits_graph(weight, m)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    (got,) = session.run(None, {"A": a})
    want = a.astype(np.float64) @ reference.T
    scale = np.abs(a).astype(np.float64) @ np.abs(reference).T  # the sum's magnitude
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


def test_types_without_an_exact_mapping_are_left_to_the_caller() -> None:
    for qtype in (T.Q2_K, T.Q3_K, T.IQ4_NL, T.F16):
        assert transcode(int(qtype), np.zeros((1, 1), np.uint8), 1, 256) is None
    with pytest.raises(ValueError, match="whole blocks"):
        transcode(int(T.Q4_0), np.zeros((1, 18), np.uint8), 1, 48)


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS), ids=lambda t: T(t).name)
def test_a_form_counts_the_bytes_the_transcode_makes(qtype: int) -> None:
    """What the route rule weighs (``BlockForm.nbytes``) is what ``transcode`` returns."""
    n, k = 8, 512
    weight = transcode(int(qtype), random_tensor(qtype, n, k), n, k)
    assert weight is not None
    made = weight.packed.nbytes + weight.scales.nbytes
    made += 0 if weight.offset is None else weight.offset.nbytes
    assert FORMS[int(qtype)].nbytes(n * k) == made


def _tensor(name: str, qtype: int, n: int, k: int) -> TensorInfo:
    """A header's record of an [n, k] matrix (``shape`` as the reader keeps it)."""
    return TensorInfo(name, (n, k), int(qtype), offset=0)


def test_a_step_reads_the_matrices_the_head_included_once() -> None:
    q4_1 = _tensor("blk.0.ffn_up.weight", T.Q4_1, 64, 256)
    norm = TensorInfo("blk.0.attn_norm.weight", (256,), int(T.F32), offset=0)
    # Q4_1: 20 bytes per 32 weights become 16 + a scale and an offset of 4 each
    assert transcode_reads([q4_1, norm]) == pytest.approx(24 / 20)
    q6_k = _tensor("output.weight", T.Q6_K, 64, 256)  # 210 bytes per 256 become 256 + 16 * 4
    embd = _tensor("token_embd.weight", T.Q4_0, 64, 256)  # untied: a step gathers one row
    assert transcode_reads([embd, q6_k]) == pytest.approx(320 / 210)
    tied = _tensor("token_embd.weight", T.Q8_0, 64, 256)  # tied: it is the head
    assert transcode_reads([tied]) == pytest.approx(36 / 34)
    wide = _tensor("blk.0.ffn_up.weight", T.Q3_K, 64, 256)  # no form: widened to float32
    assert transcode_reads([wide]) == pytest.approx(4 * 256 / 110)
    assert transcode_reads([norm]) == 1.0
