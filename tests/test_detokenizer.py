"""The streaming-text contract, property-style over random byte-level token sequences."""

from __future__ import annotations

import codecs

from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.generation.detokenizer import IncrementalDetokenizer

from .fakes import FakeTokenizer

TOK = FakeTokenizer()


def run(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(TOK.token_bytes, stop)
    chunks = [detok.push(t) for t in ids]
    chunks.append(detok.finish())
    return chunks, detok


def full_text(ids: list[int]) -> str:
    """The bytes decoded with invalid sequences as U+FFFD and an incomplete last character
    left out (the decoder still holds it: it is not text yet)."""
    data = b"".join(TOK.token_bytes(t) for t in ids)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


token_ids = st.lists(st.integers(0, TOK.n_vocab - 1), max_size=60)
utf8_texts = st.text(max_size=30)


@given(token_ids)
@settings(max_examples=300)
def test_chunks_join_to_the_full_text_and_are_valid(ids: list[int]) -> None:
    chunks, detok = run(ids)
    assert "".join(chunks) == full_text(ids) == detok.text
    for chunk in chunks:
        chunk.encode("utf-8")  # no lone surrogates: every chunk is valid text


@given(utf8_texts)
def test_characters_split_across_tokens_are_held_until_complete(text: str) -> None:
    ids = list(text.encode("utf-8"))  # one byte per token: every multi-byte char is split
    chunks, _ = run(ids)
    assert "".join(chunks) == text
    assert "\ufffd" not in "".join(chunks) or "\ufffd" in text


def test_emoji_split_over_two_tokens_comes_out_whole() -> None:
    ids = [ord("a"), 260, 261, ord("b")]  # 260/261 are the two halves of the emoji
    chunks, _ = run(ids)
    assert chunks == ["a", "", "🙂", "b", ""]


def test_incomplete_character_at_the_end_is_dropped() -> None:
    chunks, _ = run([ord("x"), 260])  # 260: the first two bytes of a four-byte emoji
    assert "".join(chunks) == "x"
    chunks, _ = run([260, ord("y"), 260])  # an invalid sequence mid-text stays visible
    assert "".join(chunks) == "\ufffdy"


def test_control_tokens_contribute_no_text() -> None:
    chunks, _ = run([256, ord("h"), 257, ord("i")])
    assert "".join(chunks) == "hi"


@given(utf8_texts, st.text(min_size=1, max_size=4), utf8_texts, st.integers(1, 4))
@settings(max_examples=300)
def test_a_stop_string_is_never_emitted_even_partly(
    before: str, stop: str, after: str, group: int
) -> None:
    data = (before + stop + after).encode("utf-8")
    # tokens of `group` bytes each, so stop strings start and end mid-token
    pieces = [data[i : i + group] for i in range(0, len(data), group)]
    detok = IncrementalDetokenizer(lambda i: pieces[i], (stop,))
    out = []
    for i in range(len(pieces)):
        out.append(detok.push(i))
        emitted = "".join(out)
        assert stop not in emitted
        if detok.stopped:
            break
    out.append(detok.finish())
    text = "".join(out)
    assert detok.stopped
    expected = (before + stop).split(stop)[0] if stop in before + stop else before
    assert text == expected
    assert text == detok.text


def test_text_that_only_looks_like_a_stop_start_is_released() -> None:
    pieces = [b"Hel", b"lo Wor", b"ld"]
    detok = IncrementalDetokenizer(lambda i: pieces[i], ("World!",))
    out = [detok.push(i) for i in range(3)]
    assert out == ["Hel", "lo ", ""]  # "World" might become "World!": held
    assert detok.finish() == "World" and not detok.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    pieces = [b"a END b STOP"]
    detok = IncrementalDetokenizer(lambda i: pieces[i], ("STOP", "END"))
    assert detok.push(0) == "a " and detok.stopped
