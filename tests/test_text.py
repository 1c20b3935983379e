"""text: tokenizer, Vocabulary and encode -> Batch, on the seed's corpus and random ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import causalattn as ca
from causalattn import masks
from causalattn.text import PAD, SEED_SENTENCES, Vocabulary, encode, tokenize

SEED_VOCAB = [
    "<PAD>",
    "<UNK>",
    "I",
    "love",
    "to",
    "eat",
    "pizza",
    "with",
    "extra",
    "cheese",
    "on",
    "top",
    "burgers",
    "ketchup",
    "On",
    "of",
    "the",
    "is",
    "Cheese",
    "and",
    "go",
    "well",
    "together",
]


def test_tokenize_words_and_punctuation_case_kept():
    assert tokenize("On top, of the pizza!") == ["On", "top", ",", "of", "the", "pizza", "!"]
    assert tokenize("  don't   stop. ") == ["don't", "stop", "."]
    assert tokenize("") == []


def test_seed_corpus_vocabulary_ids_lengths():
    b = encode(SEED_SENTENCES)
    assert (b.B, b.N) == (4, 10)
    assert b.vocab.tokens == SEED_VOCAB
    assert len(b.vocab) == 23
    assert b.lengths.tolist() == [10, 8, 8, 6]
    assert b.ids.dtype == np.int64 and b.ids.shape == (4, 10)
    assert b.ids[0].tolist() == list(range(2, 12))
    assert b.ids[3].tolist() == [18, 19, 12, 20, 21, 22, 0, 0, 0, 0]
    assert b.tokens[3] == ["Cheese", "and", "burgers", "go", "well", "together"] + [PAD] * 4
    assert b.truncated == ()
    # "On" (sentence 3) and "on" (sentence 1) are different tokens: case is kept
    assert b.vocab["On"] != b.vocab["on"]


def test_sentence_four_combined_mask_exactly():
    b = encode(SEED_SENTENCES)
    m = b.mask[3]
    assert m.dtype == np.bool_ and b.mask.shape == (4, 10, 10)
    np.testing.assert_array_equal(m[:6, :6], np.tril(np.ones((6, 6), bool)))
    assert not m[:, 6:].any()  # padding keys blocked
    assert not m[6:].any()  # padding queries read nothing
    assert b.key_padding_mask[3].tolist() == [True] * 6 + [False] * 4
    np.testing.assert_array_equal(b.causal_mask, np.tril(np.ones((10, 10), bool)))
    np.testing.assert_array_equal(b.mask[0], b.causal_mask)  # the longest sentence: plain causal
    np.testing.assert_array_equal(b.query_padding_mask, b.key_padding_mask)


def test_vocabulary_lookup_both_ways():
    v = Vocabulary(["a", "b", "a"])
    assert len(v) == 4 and v.tokens == ["<PAD>", "<UNK>", "a", "b"]
    assert v["a"] == 2 and v[3] == "b" and v["zzz"] == 1
    assert v.encode(["b", "a", "?"]) == [3, 2, 1]
    assert v.decode([0, 1, 2]) == ["<PAD>", "<UNK>", "a"]
    assert "a" in v and "c" not in v
    assert Vocabulary.from_sentences(SEED_SENTENCES) == encode(SEED_SENTENCES).vocab
    with pytest.raises(ValueError, match="text: id 9"):
        v[9]
    with pytest.raises(ValueError, match="text"):
        v[1.5]


def test_given_vocabulary_is_used_as_is():
    v = encode(SEED_SENTENCES).vocab
    b = encode(["I love sushi ."], vocab=v)
    assert b.ids[0].tolist() == [2, 3, 1, 1]
    assert b.tokens[0] == ["I", "love", "sushi", "."]  # the words themselves label the masks
    assert len(v) == 23  # not grown


def test_max_len_truncates_and_says_so():
    with pytest.warns(UserWarning, match="truncated to max_len=7: sentence 1 \\(10 tokens\\)"):
        b = encode(SEED_SENTENCES, max_len=7)
    assert b.N == 7 and b.truncated == (0, 1, 2)
    assert b.lengths.tolist() == [7, 7, 7, 6]
    assert b.tokens[0] == "I love to eat pizza with extra".split()
    # longer than every sentence: pads to max_len, no warning
    b = encode(["a b"], max_len=4)
    assert b.N == 4 and b.truncated == () and b.ids.tolist() == [[2, 3, 0, 0]]


@pytest.mark.parametrize(
    "sentences, kwargs, match",
    [
        ([], {}, "text: the corpus is empty"),
        (["a b", "   "], {}, "text: sentence 2 .* is empty"),
        (["a", 3], {}, "text: sentence 2 must be a string, got int"),
        (None, {}, "text: sentences must be"),
        (["a"], {"max_len": 0}, "text: max_len must be a positive integer"),
        (["a"], {"vocab": {"a": 2}}, "text: vocab must be a Vocabulary"),
    ],
)
def test_bad_input(sentences, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode(sentences, **kwargs)


def test_single_string_is_one_sentence_and_exports():
    b = ca.encode("Cheese and burgers")
    assert b.B == 1 and b.N == 3
    assert ca.Vocabulary is Vocabulary and isinstance(b, ca.Batch)


words = st.sampled_from(["a", "B", "cc", "a", ",", ".", "dd", "E"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(words, min_size=1, max_size=7), min_size=1, max_size=5),
    st.none() | st.integers(1, 8),
)
def test_masks_match_their_definition(corpus, max_len):
    sentences = [" ".join(ws) for ws in corpus]
    with (
        pytest.warns(UserWarning)
        if max_len is not None and max(map(len, corpus)) > max_len
        else _no_warning()
    ):
        b = encode(sentences, max_len=max_len)
    L = [min(len(ws), max_len or len(ws)) for ws in corpus]
    assert b.lengths.tolist() == L
    assert b.N == (max_len or max(L))
    for k, ws in enumerate(corpus):
        assert b.vocab.decode(b.ids[k, : L[k]]) == ws[: L[k]]
        assert (b.ids[k, L[k] :] == 0).all()
        for i in range(b.N):
            for j in range(b.N):
                assert b.mask[k, i, j] == (j <= i and i < L[k] and j < L[k])
    # the same mask the masks module builds
    expected = masks.combine(
        masks.causal(b.N)[None],
        masks.key_padding(b.lengths, b.N)[:, None, :],
        masks.query_padding(b.lengths, b.N)[:, :, None],
    )
    np.testing.assert_array_equal(b.mask, expected)


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
