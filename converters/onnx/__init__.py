"""The routes to an ONNX model folder.

- ``native.py``: ``convert_native``: a GGUF file or a safetensors folder through the native
  graph builder (``builder/``), no torch; validated against llama.cpp or transformers;
- ``folder.py``: ``write_gguf_folder``: a GGUF as a complete folder (graph, tokenizer.json,
  chat template, ``edgeinfer.json``); also what the loader uses for catalog GGUFs on ONNX Runtime;
- ``vocab.py``: a GGUF's vocabulary as the ``tokenizer.json`` that gives llama.cpp's ids;
- ``optimum.py``: ``convert_optimum``: export with optimum, quantize with onnxruntime;
- ``export.py``: optimum's export, the onnxruntime quantizers and the folder they fill;
- ``builder/``: the native graph builder.
"""
