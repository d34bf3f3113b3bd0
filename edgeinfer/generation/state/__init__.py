"""KV snapshots on disk: ``Model.save_state``/``load_state`` and the automatic prompt cache.

snapshot.py       the file format (header, fingerprint, payload, checksums; atomic writes)
fingerprint.py    what makes a KV valid (model sha256, engine, layout, settings)
sequence.py       one slot's KV copied out and in, through runtimes/*_state.py
prompt_cache.py   the folder of snapshots found again by prompt prefix (LRU-capped)
attached.py       a prompt cache bound to one model, as the generation loop calls it
session.py        save_state / load_state of a model's current sequence
"""

from __future__ import annotations

from .prompt_cache import DEFAULT_MAX_BYTES, DEFAULT_MIN_TOKENS, PromptCache

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MIN_TOKENS", "PromptCache"]
