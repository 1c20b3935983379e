"""Sentences -> Vocabulary -> padded ids, lengths, tokens and masks (a :class:`Batch`).

As in the seed: words are split at whitespace, punctuation marks are tokens of their
own, case is kept ("On" and "on" are two tokens). ``<PAD>`` is id 0, ``<UNK>`` id 1,
and every other token gets the next id in order of first appearance. N, the padded
length, is the longest sentence (or ``max_len``, which truncates longer sentences and
says so with a warning)::

    batch = encode(SEED_SENTENCES)       # N = 10
    batch.mask[3]                        # sentence 4's combined causal + padding mask

Every mask comes from :mod:`causalattn.masks` (True = may read), built when asked for:
a Batch keeps only ids, lengths and tokens, so a 100,000-word sentence costs O(N).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from . import masks as _masks

__all__ = ["PAD", "UNK", "SEED_SENTENCES", "tokenize", "Vocabulary", "Batch", "encode", "MAX_BYTES"]

PAD = "<PAD>"
UNK = "<UNK>"

# The seed's corpus (the default of `causalattn demo`).
SEED_SENTENCES: tuple[str, ...] = (
    "I love to eat pizza with extra cheese on top",
    "I love to eat burgers with extra ketchup",
    "On top of the pizza is extra cheese",
    "Cheese and burgers go well together",
)

# A word (letters/digits/underscore, with inner apostrophes: "don't") or one punctuation mark.
_TOKEN = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")


def tokenize(sentence: str) -> list[str]:
    """Word-level tokens of one sentence: words and punctuation marks, case kept."""
    if not isinstance(sentence, str):
        raise ValueError(f"text: a sentence must be a string, got {type(sentence).__name__}")
    return _TOKEN.findall(sentence)


class Vocabulary:
    """Token <-> id, ``<PAD>`` = 0, ``<UNK>`` = 1, then ids by first appearance.

    ``vocab["pizza"]`` gives an id (``<UNK>``'s for unknown tokens) and ``vocab[4]``
    a token; ``encode`` / ``decode`` do whole token lists.
    """

    def __init__(self, tokens: Iterable[str] = ()):
        self._tokens: list[str] = [PAD, UNK]
        self._ids: dict[str, int] = {PAD: 0, UNK: 1}
        for t in tokens:
            self.add(t)

    @classmethod
    def from_sentences(cls, sentences: Iterable[str]) -> Vocabulary:
        """The vocabulary of ``sentences``' tokens, ids by first appearance after the specials."""
        vocab = cls()
        for s in sentences:
            for t in tokenize(s):
                vocab.add(t)
        return vocab

    def add(self, token: str) -> int:
        """Id of ``token``, adding it at the end when new."""
        if not isinstance(token, str) or not token:
            raise ValueError(f"text: a token must be a non-empty string, got {token!r}")
        if token not in self._ids:
            self._ids[token] = len(self._tokens)
            self._tokens.append(token)
        return self._ids[token]

    @property
    def tokens(self) -> list[str]:
        """All tokens, position = id."""
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def __iter__(self):
        return iter(self._tokens)

    def __getitem__(self, key: str | int) -> int | str:
        if isinstance(key, str):
            return self._ids.get(key, 1)
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not 0 <= key < len(self._tokens):
                raise ValueError(f"text: id {key} is outside the vocabulary 0..{len(self) - 1}")
            return self._tokens[int(key)]
        raise ValueError(f"text: look up a token (str) or an id (int), got {type(key).__name__}")

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens``; unknown tokens map to ``<UNK>`` (1)."""
        return [self._ids.get(t, 1) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The tokens of ``ids`` (a row of ``Batch.ids``, shape ``(N,)``)."""
        return [self[int(i)] for i in ids]

    def to_dict(self) -> dict[str, int]:
        """Token -> id, specials included."""
        return dict(self._ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self._tokens == other._tokens

    def __repr__(self) -> str:
        shown = ", ".join(self._tokens[:8]) + (", …" if len(self) > 8 else "")
        return f"Vocabulary({len(self)} tokens: {shown})"


# Dense masks and ids past this many bytes are refused (ValueError naming the size), unless
# the caller raises ``max_bytes``: a 100,000-token sentence's N×N mask alone is 10 GB.
MAX_BYTES = 2**30


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def check_bytes(what: str, nbytes: int, max_bytes: int | None, hint: str = "") -> None:
    """Refuse ``nbytes`` above ``max_bytes`` (None: :data:`MAX_BYTES`) with one clear line."""
    limit = MAX_BYTES if max_bytes is None else int(max_bytes)
    if nbytes > limit:
        raise ValueError(
            f"{what} would take {_human(nbytes)} (limit {_human(limit)}, max_bytes)"
            + (f"; {hint}" if hint else "")
        )


class _PaddedTokens(Sequence):
    """B token lists padded with ``<PAD>`` to N on access (B×N strings are never stored)."""

    def __init__(self, toks: list[list[str]], N: int):
        self._toks, self._N = toks, N

    def __len__(self) -> int:
        return len(self._toks)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[k] for k in range(*b.indices(len(self)))]
        t = self._toks[b]
        return t + [PAD] * (self._N - len(t))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Sequence)
            and len(other) == len(self)
            and all(list(a) == list(b) for a, b in zip(self, other))
        )

    def __repr__(self) -> str:
        return f"<{len(self)} token lists padded to N = {self._N}>"


@dataclass(frozen=True, eq=False)
class Batch:
    """B sentences padded to N tokens; masks built on demand (True = may read).

    ids ``(B, N)`` int64 (``<PAD>`` = 0 after each sentence); lengths ``(B,)``;
    tokens: B lists of N strings (the sentence's own words, then ``<PAD>``); truncated:
    indices of the sentences cut to ``max_len``. The mask is the pattern causal AND
    padding of :mod:`causalattn.masks` given by N and the lengths, so it is kept lazy:
    ``mask`` ``(B, N, N)`` (a padding query row has no readable key),
    ``sentence_mask(b)`` ``N×N``, ``mask_block(q0, q1, k0, k1)`` one tile and
    ``mask_counts()`` closed-form counts; dense ones past ``max_bytes`` raise ValueError.
    """

    vocab: Vocabulary
    ids: np.ndarray
    lengths: np.ndarray
    tokens: Sequence[list[str]]
    truncated: tuple[int, ...] = ()
    max_bytes: int | None = None  # None: MAX_BYTES
    window: int | None = None  # each query reads its last `window` positions (masks.Pattern)
    chunk: int | None = None  # each query reads its own chunk of `chunk` positions

    @property
    def B(self) -> int:
        """The number of sentences B (``ids`` is ``(B, N)``)."""
        return int(self.ids.shape[0])

    @property
    def N(self) -> int:
        """The padded length N (``ids`` is ``(B, N)``)."""
        return int(self.ids.shape[1])

    def _dense(self, what: str, cells: int) -> None:
        check_bytes(
            f"text: the dense {what}",
            cells,
            self.max_bytes,
            "use batch.mask_block(...) or batch.mask_counts(), or raise max_bytes",
        )

    @property
    def key_padding_mask(self) -> np.ndarray:
        """``(B, N)``: True where the key position holds a real token."""
        return _masks.key_padding(self.lengths, self.N)

    @property
    def query_padding_mask(self) -> np.ndarray:
        """``(B, N)``: True where the query position holds a real token."""
        return _masks.query_padding(self.lengths, self.N)

    @property
    def causal_mask(self) -> np.ndarray:
        """The ``N×N`` mask shared by every sentence: causal (and window, chunk), no padding."""
        self._dense(f"causal mask {self.N}×{self.N}", self.N * self.N)
        rules = _masks.Pattern(causal=True, window=self.window, chunk=self.chunk)
        return rules.tile(1, 1, self.N, self.N)[0, 0]

    @property
    def pattern(self) -> _masks.Pattern:
        """The mask as a :class:`causalattn.masks.Pattern`: causal (+ window, chunk) AND
        padding (the seed's mask when neither window nor chunk is set)."""
        return _masks.Pattern(
            causal=True, window=self.window, chunk=self.chunk, lengths=self.lengths
        )

    def _tile(self, q0: int, q1: int, k0: int, k1: int, b=None) -> np.ndarray:
        """(B or 1, q1-q0, k1-k0) of the pattern, nothing else materialized."""
        N = self.N
        return self.pattern.tile(self.B, 1, N, N, q0, q1, k0, k1, batch=b)[:, 0]

    @cached_property
    def mask(self) -> np.ndarray:
        """``(B, N, N)`` = causal AND key padding AND query padding (built on first access)."""
        B, N = self.B, self.N
        self._dense(f"mask (B, N, N) = ({B}, {N}, {N})", B * N * N)
        return self._tile(0, N, 0, N)

    def sentence_mask(self, b: int) -> np.ndarray:
        """``N×N``: sentence b's causal AND padding mask (0-based b)."""
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not -self.B <= b < self.B:
            raise ValueError(
                f"text: sentence index b must be an integer in 0..{self.B - 1}, got {b!r}"
            )
        self._dense(f"mask {self.N}×{self.N} of sentence {int(b) % self.B + 1}", self.N * self.N)
        return self._tile(0, self.N, 0, self.N, b=[int(b) % self.B])[0]

    def mask_block(self, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """``(B, q1-q0, k1-k0)``: queries [q0, q1) × keys [k0, k1) of the mask (0-based)."""
        for name, v in (("q0", q0), ("q1", q1), ("k0", k0), ("k1", k1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= self.N:
                raise ValueError(
                    f"text: mask block {name} must be an integer in 0..N={self.N}, got {v!r}"
                )
        if q1 < q0 or k1 < k0:
            raise ValueError(
                f"text: mask block needs q0 <= q1 and k0 <= k1, got [{q0}, {q1}) × [{k0}, {k1})"
            )
        self._dense(f"mask block ({self.B}, {q1 - q0}, {k1 - k0})", self.B * (q1 - q0) * (k1 - k0))
        return self._tile(q0, q1, k0, k1)

    def mask_counts(self) -> dict[str, np.ndarray]:
        """Per sentence ``(B,)``: readable, future (causally blocked) and padding entries."""
        return _masks.counts(self.lengths, self.N, window=self.window, chunk=self.chunk)


def _sentences(sentences) -> list[str]:
    if isinstance(sentences, str):
        return [sentences]
    if sentences is None or not isinstance(sentences, (Sequence, Iterable)):
        raise ValueError(
            f"text: sentences must be a list of strings, got {type(sentences).__name__}"
        )
    out = list(sentences)
    if not out:
        raise ValueError("text: the corpus is empty; give at least one sentence")
    for b, s in enumerate(out):
        if not isinstance(s, str):
            raise ValueError(
                f"text: sentence {b + 1} must be a string, got {type(s).__name__} ({s!r:.40})"
            )
    return out


def encode(
    sentences: str | Iterable[str],
    max_len: int | None = None,
    vocab: Vocabulary | None = None,
    *,
    max_bytes: int | None = None,
    window: int | None = None,
    chunk: int | None = None,
) -> Batch:
    """Tokenize, build (or use) a vocabulary, pad to N and build the masks.

    ``sentences``: a list of strings (one string is one sentence). N is the longest
    sentence, or ``max_len`` when given; longer sentences are then truncated, listed in
    ``batch.truncated`` and reported with a warning. With ``vocab`` given it is used as
    is (unknown tokens -> ``<UNK>``); otherwise one is built from the sentences.
    ``max_bytes`` (default :data:`MAX_BYTES`) bounds the ids (B×N int64) and every dense
    mask the batch builds later; past it a ValueError names the size. ``window`` and
    ``chunk`` add those rules of :class:`causalattn.masks.Pattern` to causal AND padding.
    """
    texts = _sentences(sentences)
    toks = [tokenize(s) for s in texts]
    for b, t in enumerate(toks):
        if not t:
            raise ValueError(f"text: sentence {b + 1} ({texts[b]!r}) is empty: it has no tokens")
    if max_len is not None:
        if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
            raise ValueError(f"text: max_len must be a positive integer, got {max_len!r}")
        max_len = int(max_len)
    if vocab is None:
        vocab = Vocabulary()
        for t in toks:
            for w in t:
                vocab.add(w)
    elif not isinstance(vocab, Vocabulary):
        raise ValueError(f"text: vocab must be a Vocabulary, got {type(vocab).__name__}")

    truncated = tuple(b for b, t in enumerate(toks) if max_len is not None and len(t) > max_len)
    if truncated:
        cut = ", ".join(f"sentence {b + 1} ({len(toks[b])} tokens)" for b in truncated)
        warnings.warn(f"text: truncated to max_len={max_len}: {cut}", stacklevel=2)
        toks = [t[:max_len] for t in toks]
    N = max_len if max_len is not None else max(len(t) for t in toks)
    B = len(toks)
    check_bytes(
        f"text: ids (B, N) = ({B}, {N}) int64",
        8 * B * N,
        max_bytes,
        "give a smaller max_len" if max_len is not None else "",
    )

    lengths = np.array([len(t) for t in toks], dtype=np.int64)
    ids = np.zeros((B, N), dtype=np.int64)  # <PAD> = 0
    for b, t in enumerate(toks):
        ids[b, : len(t)] = vocab.encode(t)
    _masks.Pattern(window=window, chunk=chunk)  # checked here, by the one definition of M
    return Batch(vocab, ids, lengths, _PaddedTokens(toks, N), truncated, max_bytes, window, chunk)
