"""The ONNX side of the converters: the native graph builder (``builder/``) and its routes."""
