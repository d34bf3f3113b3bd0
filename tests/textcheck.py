"""Machine-independent checks of generated text: references computed from the same run's
token ids, and a bias that forces multi-byte output whatever the CPU's kernels pick."""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from edgeinfer.model import Model


def reference_text(model: Model, ids: Sequence[int]) -> str:
    """The text ``ids`` stand for under the streaming contract: invalid UTF-8 as U+FFFD, an
    incomplete last character left out."""
    data = b"".join(model._tokenizer.token_bytes(int(t)) for t in ids)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def non_ascii_bias(model: Model) -> dict[int, float]:
    """Bans every token whose bytes are all ASCII (and every textless token, EOS included):
    whatever the model prefers on this machine, its reply is multi-byte text."""
    tokenizer = model._tokenizer
    banned = {}
    for token in range(tokenizer.n_vocab):
        data = tokenizer.token_bytes(token)
        if all(b < 0x80 for b in data):  # b"" too
            banned[token] = -math.inf
    return banned
