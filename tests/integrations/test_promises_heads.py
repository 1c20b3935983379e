"""What the head scores and the HF head tools promise, each pinned by the behaviour that
would break: the induction score of a token seen three times or more reads its latest
earlier copy; the probe never draws a pad, eos or bos id; mean ablation entered again
measures its means afresh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from causalattn.inspect import head_scores

# token 5 at positions 0, 2, 4, 6 and 9; each other token once
IDS = [5, 6, 5, 7, 5, 8, 5, 3, 4, 5, 2]


def _latest_copy(ids):
    """By hand: the last j < i with ids[j] == ids[i] (-1 when none)."""
    return [max((j for j in range(i) if ids[j] == ids[i]), default=-1) for i in range(len(ids))]


def _copier(ids, which):
    """Weights (T, T) of a head that reads, on each row with an earlier copy, the token after
    ``which`` copy ("latest" or "first"); rows without one read themselves."""
    T = len(ids)
    A = np.zeros((T, T))
    for i in range(T):
        copies = [j for j in range(i) if ids[j] == ids[i]]
        A[i, (copies[-1] if which == "latest" else copies[0]) + 1 if copies else i] = 1.0
    return A


def test_the_induction_score_reads_the_latest_earlier_copy():
    assert sum(1 for j in _latest_copy(IDS) if j >= 0) == 4  # rows 2, 4, 6, 9
    perfect = head_scores(_copier(IDS, "latest"), ids=IDS)["induction"]
    assert perfect.shape == (1,) and perfect[0] == pytest.approx(1.0)
    # a head that reads after the FIRST copy is right only where the first is the latest
    first = head_scores(_copier(IDS, "first"), ids=IDS)["induction"]
    assert first[0] == pytest.approx(1 / 4)


def test_the_induction_score_per_sequence_of_a_batch():
    other = [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1]  # every token repeated five times or more
    A = np.stack([_copier(IDS, "latest"), _copier(other, "latest")])[:, None]  # (2, 1, T, T)
    got = head_scores(A, ids=np.array([IDS, other]))["induction"]
    assert got[0] == pytest.approx(1.0)
    swapped = head_scores(A, ids=np.array([other, IDS]))["induction"]
    assert swapped[0] < 0.5  # each sequence's own copies, not the other's


# ---- the HF side ------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

import _hf_tiny as tiny  # noqa: E402

from causalattn.integrations.hf_heads import probe_ids  # noqa: E402
from causalattn.integrations.transformers import ablate  # noqa: E402


def _special(model, tok) -> set[int]:
    ids = set()
    for src in (model.config, tok):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            v = getattr(src, name, None) if src is not None else None
            ids |= set(v) if isinstance(v, (list, tuple)) else ({v} if v is not None else set())
    return ids


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["tokenizer", "no-tokenizer"])
def test_the_probe_never_draws_pad_eos_or_bos(with_tokenizer):
    model = tiny.model("gpt2")
    tok = tiny.tokenizer() if with_tokenizer else None
    special = _special(model, tok)
    assert special == {0, 1, 2}
    # every id but the special ones, in each of many sequences: any special one would show
    n = tiny.VOCAB - len(special)
    ids, bos = probe_ids(model, tok, length=min(n, 31), sequences=64, seed=0)
    body = ids[:, int(bos) :]
    assert not set(body.flatten().tolist()) & special
    if with_tokenizer:  # the BOS in front is the tokenizer's own, only there
        assert bos and (ids[:, 0] == tok.bos_token_id).all()


def test_mean_ablation_entered_again_measures_fresh_means():
    model = tiny.model("gpt2")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, tiny.VOCAB, (2, 12), generator=g)
    b = torch.randint(3, tiny.VOCAB, (2, 12), generator=g)
    heads = [(0, 1), (1, 2)]
    with torch.no_grad():
        with ablate(model, heads, how="mean"):
            fresh = model(b).logits  # the means of b
        ctx = ablate(model, heads, how="mean")
        with ctx:
            model(a)  # the means of a
            stale = model(b).logits  # (inside one entry the first call's means stay)
        with ctx:
            again = model(b).logits  # entered again: the means of b, measured afresh
    assert not torch.allclose(stale, fresh)  # the test can tell the two apart
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
