"""The route to a GGUF file.

- ``route.py``: ``convert_gguf``: a Hugging Face folder written as GGUF (quantized by llama.cpp
  from an f16 intermediate when asked), or a GGUF quantized; validated, then moved into place;
- ``writer.py``: the GGUF writer (safetensors read one tensor at a time) and llama.cpp's
  quantizer;
- ``tokenizer.py``: a checkpoint's byte-level BPE tokenizer as GGUF metadata.
"""
