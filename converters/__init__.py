"""Workstation-side tools that turn a model into files a device can run (ONNX, GGUF).

Heavy dependencies (torch, optimum, transformers) are imported inside the functions that need
them, never at import time.
"""
