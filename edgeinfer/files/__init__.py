"""Files read without an engine: what a model file or folder holds, checked before any native
library opens it.

- ``gguf_file``, ``gguf_checks``, ``gguf_eog``: a GGUF header, its checks, its end tokens;
- ``onnx_graph``: facts read from an ONNX protobuf (external data locations, input types);
- ``manifest``, ``genai_folder``, ``encoder_folder``: converted folders, onnxruntime-genai
  folders and sentence-transformers folders as manifests;
- ``catalog``, ``catalog_chunks``, ``catalog_folder``: the model catalog and its fetchers;
- ``source``: ``resolve()``, what a user named as a file on disk with its format and header.
"""
