"""The int4/int8 re-rounding quantizer: searched scales never lose to round-to-nearest, the
blocks are what MatMulNBits computes, and hostile weights are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgeinfer.converters.onnx.builder.linear import requantize
from edgeinfer.converters.onnx.quantize import block_errors, quantize_rtn, quantize_searched
from edgeinfer.errors import ConversionError, EdgeInferError

_TOLERANCE = 1e-5  # float32 sums of 32 squares: the refit's error is computed, not exact


def _gaussian(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_search_beats_round_to_nearest_on_random_weights(bits: int) -> None:
    w = _gaussian(256, 576)
    searched = block_errors(w, quantize_searched(w, bits))
    rtn = block_errors(w, quantize_rtn(w, bits))
    assert (searched <= rtn * (1 + _TOLERANCE) + 1e-9).all()
    # the promise: a clearly smaller error over the tensor, not a tie
    assert searched.sum() < 0.93 * rtn.sum()


def test_weighted_search_lowers_the_weighted_error() -> None:
    w = _gaussian(64, 128, seed=1)
    importance = np.random.default_rng(2).uniform(0.0, 4.0, 128).astype(np.float32)
    weighted = quantize_searched(w, 4, importance=importance)
    plain = quantize_searched(w, 4)
    assert block_errors(w, weighted, importance).sum() <= block_errors(w, plain, importance).sum()


_finite = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(
    w=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.sampled_from([32, 64, 96])),
        elements=_finite,
    ),
    bits=st.sampled_from([4, 8]),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]),
)
def test_every_block_is_no_worse_than_round_to_nearest(
    w: np.ndarray, bits: int, scale: float
) -> None:
    w = (w * np.float32(scale)).astype(np.float32)
    got = quantize_searched(w, bits)
    searched, rtn = block_errors(w, got), block_errors(w, quantize_rtn(w, bits))
    assert np.isfinite(got.scales).all()
    # a scale is stored in float32: an exact block may keep an error of ~eps² of its energy
    energy = (w.astype(np.float64) ** 2).reshape(-1, 32).sum(axis=1)
    assert (searched <= rtn * (1 + _TOLERANCE) + 1e-12 * energy).all()
    assert int(got.u.max()) < (1 << bits)
    zero_blocks = ~w.reshape(-1, 32).any(axis=1)
    assert (got.dequantize().reshape(-1, 32)[zero_blocks] == 0).all()


@pytest.mark.parametrize(
    "bad",
    [
        np.full((2, 32), np.nan, np.float32),
        np.full((2, 32), np.inf, np.float32),
        np.zeros((2, 33), np.float32),
        np.zeros(32, np.float32),
    ],
    ids=["nan", "inf", "ragged", "one-dimensional"],
)
def test_weights_it_cannot_quantize_are_refused_with_a_conversion_error(bad: np.ndarray) -> None:
    with pytest.raises(ConversionError) as caught:
        quantize_searched(bad, 4)
    assert isinstance(caught.value, EdgeInferError)


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_are_what_matmulnbits_computes(bits: int) -> None:
    """The packing (nibble order, scales' layout) as onnxruntime reads it: the node's output
    equals x @ W.T for the W the integers and scales stand for."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    n, k = 48, 128
    w = _gaussian(n, k, seed=3)
    q = requantize(w, bits)
    node = helper.make_node(
        "MatMulNBits",
        ["x", "packed", "scales"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=32,
        accuracy_level=0,
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [
            numpy_helper.from_array(q.packed, "packed"),
            numpy_helper.from_array(q.scales.reshape(-1), "scales"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = _gaussian(1, k, seed=4)
    (y,) = session.run(None, {"x": x})
    expected = quantize_searched(w, bits).dequantize()  # from the integers, not the bytes
    np.testing.assert_allclose(y, x @ expected.T, rtol=1e-4, atol=1e-4)
