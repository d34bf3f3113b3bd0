"""The machine a model runs on, and what runs it there.

- ``probes``: where facts about a machine come from (files, engines), replayable in tests;
- ``inventory``: ``devices()``, the CPU, memory and accelerators read once per process;
- ``busy``: the cores this process may use and how many other processes keep busy;
- ``policy``: ``plan_providers``, the execution providers for a format on this machine;
- ``routes``: which engine runs a model (llama.cpp on a GGUF, or onnxruntime on a graph).
"""
