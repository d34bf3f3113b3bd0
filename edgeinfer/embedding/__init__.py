"""Embeddings: an encoder model opened from a sentence-transformers folder or a GGUF, and texts
checked, batched and pooled through it.

- ``batches``: texts checked where they enter, tokenized, run in batches, pooled;
- ``load``: opening an encoder folder, built once into a graph under ``derived/``;
- ``gguf``: GGUF encoders through llama.cpp's embedding mode.
"""
