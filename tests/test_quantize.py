"""The int4/int8 re-rounding quantizer: searched scales never lose to round-to-nearest, the
blocks are what MatMulNBits computes, and hostile weights are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
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


_FLOAT32_MAX = float(np.finfo(np.float32).max)
# every finite float32, subnormals, ±0, the smallest normal and the largest included
_any_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_KINDS = ("as drawn", "scaled", "constant", "one value", "mixed magnitudes")


@st.composite
def _weights(draw: st.DrawFn) -> np.ndarray:
    """Blocks of every magnitude float32 holds: as drawn from the whole range, a normal block
    scaled by 2**-160 .. 2**127 (down into subnormals and zeros, up to the largest value),
    constant blocks, one value in zeros, and blocks mixing magnitudes 2**±100 apart."""
    shape = (draw(st.integers(1, 4)), draw(st.sampled_from([32, 64, 96])))
    kind = draw(st.sampled_from(_KINDS))
    if kind == "as drawn":
        return draw(hnp.arrays(np.float32, shape, elements=_any_float32))
    base = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e4, 1e4, width=32)))
    w = base.astype(np.float64) * 2.0 ** draw(st.integers(-160, 127))
    if kind == "constant":
        w[:] = w.flat[0]
    elif kind == "one value":
        w = np.where(np.arange(w.size).reshape(shape) == draw(st.integers(0, w.size - 1)), w, 0)
    elif kind == "mixed magnitudes":
        w = w * 2.0 ** draw(hnp.arrays(np.int64, shape, elements=st.integers(-100, 100)))
    return np.clip(w, -_FLOAT32_MAX, _FLOAT32_MAX).astype(np.float32)


_SMALLEST_NORMAL = np.full((1, 32), np.finfo(np.float32).tiny, np.float32)


@settings(max_examples=150, deadline=None)
@given(w=_weights(), bits=st.sampled_from([4, 8]))
# found by hypothesis: the searched scale (2**-129) stored as a subnormal float32 lost bits
# that round-to-nearest's scale kept (error 6.3e-89 against 0)
@example(w=_SMALLEST_NORMAL, bits=4)
@example(w=_SMALLEST_NORMAL * np.float32(1e4), bits=8)
@example(w=np.full((1, 32), 1.4e-45, np.float32), bits=4)  # the smallest subnormal
@example(w=np.full((2, 32), -_FLOAT32_MAX, np.float32), bits=4)
# the largest value beside 31 copies of -0.51 of it: a searched scale whose -8 passes float32
@example(w=np.array([[_FLOAT32_MAX] + [-_FLOAT32_MAX * 0.51] * 31], np.float32), bits=4)
def test_every_block_is_no_worse_than_round_to_nearest(w: np.ndarray, bits: int) -> None:
    got, rtn = quantize_searched(w, bits), quantize_rtn(w, bits)
    assert np.isfinite(got.scales).all() and np.isfinite(rtn.scales).all()
    # both errors in float64 against the scales as stored: no tolerance
    assert (block_errors(w, got) <= block_errors(w, rtn)).all()
    assert int(got.u.max()) < (1 << bits)
    assert np.isfinite(got.dequantize()).all()  # what MatMulNBits computes, in float32
    zero_blocks = ~w.reshape(-1, 32).any(axis=1)
    assert (got.dequantize().reshape(-1, 32)[zero_blocks] == 0).all()


@settings(max_examples=40, deadline=None)
@given(
    w=_weights(),
    importance=hnp.arrays(
        np.float32, 96, elements=st.floats(0, 1e6, width=32) | st.just(np.float32(0))
    ),
)
def test_weighted_blocks_are_no_worse_than_round_to_nearest(
    w: np.ndarray, importance: np.ndarray
) -> None:
    importance = importance[: w.shape[1]]
    got = quantize_searched(w, 4, importance=importance)
    rtn = quantize_rtn(w, 4)
    assert (block_errors(w, got, importance) <= block_errors(w, rtn, importance)).all()


@pytest.mark.parametrize(
    "importance",
    [np.full(32, np.nan), np.full(32, np.inf), np.full(32, -1.0), np.ones(31), np.ones((3, 32))],
    ids=["nan", "inf", "negative", "short", "wrong-rows"],
)
def test_importance_it_cannot_use_is_refused_with_a_conversion_error(
    importance: np.ndarray,
) -> None:
    with pytest.raises(ConversionError, match="importance"):
        quantize_searched(np.ones((2, 32), np.float32), 4, importance=importance)


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
