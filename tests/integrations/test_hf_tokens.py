"""Readable tokens (hf_trace.token_strings): byte-level pieces go through tokenizers' own
ByteLevel decoder (not a hand-written copy of its byte alphabet)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402

from causalattn.integrations.hf_trace import token_strings  # noqa: E402


class _Pieces:
    """A tokenizer that hands back the given pieces, byte-level or not."""

    def __init__(self, pieces, byte_level: bool):
        self.pieces = pieces
        if byte_level:
            self.backend_tokenizer = SimpleNamespace(decoder=tokenizers.decoders.ByteLevel())

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_byte_level_pieces_read_as_their_text():
    # GPT-2's stand-ins: Ġ a space, Ċ a newline, 'Ã©' the two bytes of é, 'æĹ¥' the three of 日
    pieces = ["Hello", "Ġworld", "Ċ", "Ã©", "Ã", "æĹ¥", "<|endoftext|>", "▁x", None]
    want = ["Hello", " world", "\n", "é", "\ufffd", "日", "<|endoftext|>", " x", "<8>"]
    assert token_strings(_Pieces(pieces, True), range(len(pieces))) == want


def test_every_byte_of_a_trained_tokenizer_reads_as_that_byte():
    tok = tiny.tokenizer()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    assert len(alphabet) == 256
    got = token_strings(tok, [tok.convert_tokens_to_ids(c) for c in alphabet])
    ascii_ = [s for s in got if s != "\ufffd"]
    # each ASCII byte alone is its character; a lone byte past ASCII is part of a
    # UTF-8 character, so U+FFFD
    assert sorted(ascii_) == [chr(b) for b in range(128)]
    assert got.count("\ufffd") == 128
    text = "The cat sat on the mat."
    assert "".join(token_strings(tok, tok(text)["input_ids"])) == text


def test_other_pieces_keep_sentencepiece_spaces_and_no_tokenizer_gives_ids():
    assert token_strings(_Pieces(["▁The", "Ġcat", None], False), [0, 1, 2]) == [
        " The",
        "Ġcat",
        "<2>",
    ]
    assert token_strings(None, [5, 6]) == ["5", "6"]
