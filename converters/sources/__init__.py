"""What a conversion reads, checked before anything is written.

- ``checkpoint.py``: the source as a Hugging Face checkpoint folder (safetensors only unless
  pickle is allowed; a GGUF dequantized by transformers for the optimum route), its sha256;
- ``hf_config.py``: ``config.json`` read into a ModelConfig, every field typed and bounded;
- ``safetensors_reader.py``: safetensors headers checked and tensors read through a memory map;
- ``hf_source.py``: a checkpoint's tensors under GGUF names, for the native ONNX builder.
"""
