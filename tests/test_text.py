"""text: tokenizer, Vocabulary and encode -> Batch, on the seed's corpus and random ones."""

from __future__ import annotations

import dataclasses

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
    assert b.lengths.tolist() == [10, 8, 8, 6] and b.lengths.dtype == np.int64
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


def _dense_mask(lengths, N, window=None, chunk=None):
    """Causal AND padding (AND window, chunk) from the rules, cell by cell."""
    m = np.zeros((len(lengths), N, N), bool)
    for b, L in enumerate(lengths):
        for i in range(N):
            for j in range(N):
                ok = j <= i < L and j < L
                if window is not None:
                    ok &= i - j < window
                if chunk is not None:
                    ok &= i // chunk == j // chunk
                m[b, i, j] = ok
    return m


@pytest.mark.parametrize("window,chunk", [(None, None), (2, None), (None, 3), (3, 2)])
def test_every_mask_view_is_the_pattern_with_window_and_chunk(window, chunk):
    b = encode(SEED_SENTENCES, window=window, chunk=chunk)
    assert (b.window, b.chunk) == (window, chunk)
    dense = _dense_mask([10, 8, 8, 6], 10, window, chunk)
    np.testing.assert_array_equal(b.mask, dense)
    np.testing.assert_array_equal(b.causal_mask, _dense_mask([10], 10, window, chunk)[0])
    for k in range(4):
        np.testing.assert_array_equal(b.sentence_mask(k), dense[k])
        np.testing.assert_array_equal(b.sentence_mask(k - 4), dense[k])  # negative: from the end
    for q0, q1, k0, k1 in ((0, 10, 0, 10), (1, 5, 2, 6), (3, 3, 0, 10), (9, 10, 9, 10)):
        np.testing.assert_array_equal(b.mask_block(q0, q1, k0, k1), dense[:, q0:q1, k0:k1])
    c = b.mask_counts()
    assert c["readable"].tolist() == [int(x.sum()) for x in dense]
    pad = np.array([[i >= L or j >= L for i in range(10) for j in range(10)] for L in b.lengths])
    assert c["padding"].tolist() == pad.sum(1).tolist()
    assert b.pattern.describe() == " + ".join(
        ["causal"]
        + ([f"window {window}"] if window else [])
        + ([f"chunk {chunk}"] if chunk else [])
        + ["padding"]
    )
    np.testing.assert_array_equal(b.pattern.allowed(4, 1, 10, 10)[:, 0], dense)


@pytest.mark.parametrize("kw,match", [({"window": 0}, "window"), ({"chunk": -1}, "chunk")])
def test_bad_window_or_chunk_is_refused_by_the_pattern(kw, match):
    with pytest.raises(ValueError, match=f"^mask: {match} must be >= 1, got -?[01]$"):
        encode(["a b"], **kw)


@pytest.mark.parametrize("b", [4, -5, 1.0, True, "0", None])
def test_sentence_mask_index_is_checked(b):
    batch = encode(SEED_SENTENCES)
    with pytest.raises(
        ValueError, match=r"^text: sentence index b must be an integer in 0..3, got "
    ):
        batch.sentence_mask(b)


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 11, 0, 1), "q1 must be an integer in 0..N=10, got 11"),
        ((-1, 1, 0, 1), "q0 must be an integer in 0..N=10, got -1"),
        ((0, 1, 0, 11), "k1 must be an integer in 0..N=10, got 11"),
        ((0, 1, -1, 1), "k0 must be an integer in 0..N=10, got -1"),
        ((0, 1, 0.0, 1), "k0 must be an integer"),
        ((0, True, 0, 1), "q1 must be an integer"),
        ((5, 4, 0, 1), r"needs q0 <= q1 and k0 <= k1, got \[5, 4\) × \[0, 1\)"),
        ((0, 1, 3, 2), r"needs q0 <= q1 and k0 <= k1, got \[0, 1\) × \[3, 2\)"),
    ],
)
def test_mask_block_bounds_are_checked(args, match):
    with pytest.raises(
        ValueError, match=f"^text: mask block {match}" if "needs" not in match else match
    ):
        encode(SEED_SENTENCES).mask_block(*args)


def test_max_bytes_bounds_every_dense_mask_and_the_ids():
    with pytest.raises(ValueError) as e:  # ids: 8·4·10 = 320 bytes
        encode(SEED_SENTENCES, max_bytes=319)
    assert (
        str(e.value) == "text: ids (B, N) = (4, 10) int64 would take 320 B (limit 319 B, max_bytes)"
    )
    with pytest.raises(ValueError, match=r"; give a smaller max_len$"):
        encode(SEED_SENTENCES, max_len=10, max_bytes=319)
    b = encode(SEED_SENTENCES, max_bytes=320)  # exactly at the limit: fine
    with pytest.raises(ValueError) as e:
        _ = b.mask
    assert str(e.value) == (
        "text: the dense mask (B, N, N) = (4, 10, 10) would take 400 B (limit 320 B, max_bytes); "
        "use batch.mask_block(...) or batch.mask_counts(), or raise max_bytes"
    )
    with pytest.raises(
        ValueError, match=r"^text: the dense mask block \(4, 9, 9\) would take 324 B"
    ):
        b.mask_block(0, 9, 0, 9)
    assert b.mask_block(0, 8, 0, 10).shape == (4, 8, 10)  # 320 cells: at the limit
    small = dataclasses.replace(b, max_bytes=99)  # below one 10×10 mask (and the ids)
    for call, what in (
        (lambda: small.sentence_mask(2), "mask 10×10 of sentence 3"),
        (lambda: small.sentence_mask(-1), "mask 10×10 of sentence 4"),
        (lambda: small.causal_mask, "causal mask 10×10"),
    ):
        with pytest.raises(ValueError, match=f"^text: the dense {what} would take 100 B"):
            call()
    assert small.mask_counts()["readable"].tolist() == [55, 36, 36, 21]  # counts: no dense mask
    assert ca.text.MAX_BYTES == 2**30 and encode(["a"]).max_bytes is None


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (2**20, "1.0 MiB"),
        (3 * 2**30, "3.0 GiB"),
        (2**40, "1.0 TiB"),
        (2**50, "1.0 PiB"),
        (2**60, "1024.0 PiB"),
    ],
)
def test_sizes_are_said_in_binary_units(n, text):
    from causalattn.text import _human, check_bytes

    assert _human(n) == text
    check_bytes("x", n, n)  # at the limit: fine
    if n:
        with pytest.raises(ValueError, match=rf"^x would take {text} \(limit {_human(n - 1)}, "):
            check_bytes("x", n, n - 1)


def test_padded_tokens_are_lists_of_N_on_access():
    b = encode(["a b c", "d"])
    t = b.tokens
    assert len(t) == 2 and t[1] == ["d", PAD, PAD] and t[-1] == t[1]
    assert t[0:2] == [["a", "b", "c"], ["d", PAD, PAD]] and t[1:] == [["d", PAD, PAD]]
    assert t == [["a", "b", "c"], ["d", PAD, PAD]] and t == (("a", "b", "c"), ("d", PAD, PAD))
    assert t != [["a", "b", "c"]] and t != [["a", "b", "c"], ["d"]] and t != "ab"
    assert repr(t) == "<2 token lists padded to N = 3>"
    assert list(t) == [["a", "b", "c"], ["d", PAD, PAD]]


def test_vocabulary_adds_iterates_compares_and_prints():
    v = Vocabulary()
    assert v.tokens == [PAD, "<UNK>"] and len(v) == 2
    assert v.add("x") == 2 and v.add("y") == 3 and v.add("x") == 2 and len(v) == 4
    assert list(v) == [PAD, "<UNK>", "x", "y"] and v.to_dict() == {
        PAD: 0,
        "<UNK>": 1,
        "x": 2,
        "y": 3,
    }
    v.tokens.append("z")  # a copy: the vocabulary is unchanged
    assert len(v) == 4 and v[np.int64(3)] == "y" and v[-0] == PAD
    for bad in ("", 3, None):
        with pytest.raises(ValueError, match=r"^text: a token must be a non-empty string, got "):
            v.add(bad)
    with pytest.raises(ValueError, match=r"^text: id -1 is outside the vocabulary 0..3$"):
        v[-1]
    with pytest.raises(ValueError, match=r"^text: id 4 is outside the vocabulary 0..3$"):
        v[4]
    with pytest.raises(
        ValueError, match=r"^text: look up a token \(str\) or an id \(int\), got bool$"
    ):
        v[True]
    assert Vocabulary(["x", "y"]) == v and Vocabulary(["y", "x"]) != v and v != v.tokens
    assert repr(v) == "Vocabulary(4 tokens: <PAD>, <UNK>, x, y)"
    assert repr(Vocabulary("abcdefg")) == "Vocabulary(9 tokens: <PAD>, <UNK>, a, b, c, d, e, f, …)"
    assert Vocabulary.from_sentences(["b a", "a c"]).tokens == [PAD, "<UNK>", "b", "a", "c"]


def test_tokenize_refuses_what_is_not_a_string_and_keeps_apostrophes():
    with pytest.raises(ValueError, match="^text: a sentence must be a string, got bytes$"):
        tokenize(b"a b")
    assert tokenize("it’s o'clock—now") == ["it’s", "o'clock", "—", "now"]
    assert tokenize("x_1 2x") == ["x_1", "2x"]


def test_sentences_as_any_sequence_and_messages_name_the_sentence():
    assert encode(("a", "b c")).lengths.tolist() == [1, 2]
    assert encode(iter(["a b"])).N == 2
    with pytest.raises(ValueError, match=r"^text: sentences must be a list of strings, got int$"):
        encode(5)
    with pytest.raises(
        ValueError, match=r"^text: sentence 2 \('   '\) is empty: it has no tokens$"
    ):
        encode(["a", "   "])
    with pytest.raises(
        ValueError, match=r"^text: sentence 3 must be a string, got list \(\['x'\]\)$"
    ):
        encode(["a", "b", ["x"]])
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"^text: max_len must be a positive integer, got "):
            encode(["a"], max_len=bad)
    with pytest.warns(UserWarning, match="max_len=2"):
        assert encode(["a b c"], max_len=np.int64(2)).N == 2
    with pytest.warns(
        UserWarning,
        match=r"^text: truncated to max_len=1: sentence 1 \(2 tokens\), sentence 3 \(3 tokens\)$",
    ):
        b = encode(["a b", "c", "d e f"], max_len=1)
    assert b.truncated == (0, 2) and b.tokens[2] == ["d"]


def test_the_rest_of_the_messages_and_edges():
    from causalattn.text import check_bytes

    with pytest.raises(ValueError) as e:
        check_bytes("x", 2, 1)  # no hint: nothing after the limit
    assert str(e.value) == "x would take 2 B (limit 1 B, max_bytes)"
    with pytest.raises(ValueError) as e:
        encode([])
    assert str(e.value) == "text: the corpus is empty; give at least one sentence"
    with pytest.raises(ValueError) as e:
        encode(["a"], vocab={"a": 2})
    assert str(e.value) == "text: vocab must be a Vocabulary, got dict"
    assert repr(Vocabulary("abcdef")) == "Vocabulary(8 tokens: <PAD>, <UNK>, a, b, c, d, e, f)"
    b = encode(SEED_SENTENCES, max_bytes=320)
    assert b.mask_block(0, 3, 2, 2).shape == (4, 3, 0) and b.mask_block(5, 5, 0, 0).shape == (
        4,
        0,
        0,
    )
    with pytest.raises(ValueError, match=r"^text: the dense mask block \(4, 9, 9\) would take"):
        b.mask_block(1, 10, 1, 10)
    assert b.mask_block(2, 10, 0, 10).shape == (4, 8, 10)  # 320 cells: at the limit
    assert b.mask_block(0, 10, 2, 10).shape == (4, 10, 8)


def test_the_truncation_warning_points_at_encodes_caller():
    """At the file that called encode (stacklevel 2). Under mutmut encode is wrapped by its
    trampoline, which is then the caller (in mutmut's own file, one frame or two deep: this
    test cannot tell stacklevel 2 from 3 there; docs/design.md)."""
    with pytest.warns(UserWarning, match="truncated") as w:
        encode(["a b c"], max_len=2)
    wrapper = ca.text.encode.__code__.co_filename
    want = __file__ if wrapper == ca.text.__file__ else wrapper
    assert w[0].filename == want
