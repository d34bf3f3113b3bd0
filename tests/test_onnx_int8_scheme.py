"""Which MatMuls the optimum route's int8 keeps float (issue 28): the MLP's down projections
and every projection of the first and last layer; the fidelity itself is checked on the real
model in tests/test_onnx_backend.py."""

from __future__ import annotations

from edgeinfer.converters.onnx.export import _float_matmuls


def _names(layers: int) -> list[str]:
    parts = ("self_attn/q_proj", "self_attn/o_proj", "mlp/up_proj", "mlp/down_proj")
    return [f"/model/layers.{i}/{p}/MatMul" for i in range(layers) for p in parts] + [
        "/lm_head/MatMul"
    ]


def test_down_projections_and_the_edge_layers_stay_float() -> None:
    kept = set(_float_matmuls(_names(12)))
    assert {f"/model/layers.{i}/mlp/down_proj/MatMul" for i in range(12)} <= kept
    for edge in (0, 11):
        assert {n for n in _names(12) if f"layers.{edge}/" in n} <= kept
    # the middle layers' other projections and the head are quantized
    assert "/model/layers.5/self_attn/q_proj/MatMul" not in kept
    assert "/model/layers.1/mlp/up_proj/MatMul" not in kept
    assert "/lm_head/MatMul" not in kept
    assert len(kept) == 12 + 2 * 3


def test_a_graph_without_layer_names_keeps_only_down_projections() -> None:
    names = ["/a/down_proj/MatMul", "/a/up_proj/MatMul", "/layers.10x/MatMul"]
    assert _float_matmuls(names) == ["/a/down_proj/MatMul"]
