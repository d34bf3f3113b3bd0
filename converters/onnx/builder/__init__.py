"""The native ONNX graph builder: a GGUF file (or a safetensors folder read as one) becomes an
onnxruntime decoder graph with contrib operators (GroupQueryAttention, MatMulNBits,
SkipSimplifiedLayerNormalization), its weights taken from the file as they are; no torch,
transformers or optimum.

What lives where:

- ``build`` — ``build_onnx_from_gguf``: opens the source, makes the frozen ``BuildContext``,
  saves the graph;
- ``context`` — ``BuildContext`` (what every graph function takes), ``Quant``, ``BuildReport``;
- ``arch`` — ``Arch`` and the ``ARCHITECTURES`` table, ``Shape`` and ``gguf_shape``;
- ``decoder`` — the graph's inputs and outputs, and a layer as a recipe of parts;
- ``attention`` — q/k/v, GroupQueryAttention, the rotary caches and mask lengths;
- ``parts`` — embedding, RMSNorms, activations, the MLP, the output head;
- ``linear`` — a projection as MatMulNBits (with the offset term for block types that have a
  minimum) or a float MatMul;
- ``gguf_blocks`` — weight transcoding alone: GGUF blocks -> MatMulNBits inputs, no graph;
- ``graph`` — the node list and initializers, large ones written to ``model.onnx.data``;
- ``tensors`` — reading a GGUF file's tensors.

Adding an architecture: an entry in ``arch.ARCHITECTURES`` (its GGUF ``general.architecture``
-> an ``Arch`` naming what differs from a Llama layer), plus the same name in
``edgeinfer.files.gguf_checks`` (which checks the header first). Where it needs an operator the
builder lacks, add one function in the module of its part (an activation to
``parts.ACTIVATIONS``) and an ``Arch`` field that the part reads.
"""

from .arch import SUPPORTED_ARCHITECTURES, gguf_shape
from .build import build_onnx_from_gguf
from .context import KV_DTYPES, QUANTS, BuildReport

__all__ = [
    "KV_DTYPES",
    "QUANTS",
    "SUPPORTED_ARCHITECTURES",
    "BuildReport",
    "build_onnx_from_gguf",
    "gguf_shape",
]
