"""`causalattn masks --window/--chunk`: the one M on the command line, dense and summarized."""

import json
import subprocess
import sys

import numpy as np
import pytest

from causalattn import masks, text


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "causalattn.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_window_masks_json_are_the_pattern_cell_by_cell():
    r = _cli("masks", "the cat sat on the mat today", "a dog ran", "--window", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pattern"] == "causal + window 3 + padding"
    want = masks.Pattern(window=3, lengths=[7, 3]).allowed(2, 1, 7, 7)[:, 0]
    for b, sent in enumerate(out["sentences"]):
        assert np.array_equal(np.array(sent["combined"], bool), want[b])
    assert np.array_equal(
        np.array(out["causal"], bool), masks.Pattern(window=3).allowed(1, 1, 7, 7)[0, 0]
    )


@pytest.mark.parametrize("rule", [{"window": 50}, {"chunk": 64}])
def test_summarized_counts_equal_a_dense_count(rule):
    words = " ".join(f"w{i % 97}" for i in range(1500))
    batch = text.encode([words, "short one"], **rule)
    counts = batch.mask_counts()
    dense = masks.Pattern(**rule, lengths=batch.lengths).allowed(2, 1, batch.N, batch.N)[:, 0]
    reasons = masks.Pattern(**rule, lengths=batch.lengths).reasons(2, 1, batch.N, batch.N)[:, 0]
    name = next(iter(rule))
    for b in range(2):
        assert counts["readable"][b] == dense[b].sum()
        assert counts["padding"][b] == (reasons[b] == masks.PADDING).sum()
        assert counts["future"][b] == (reasons[b] == masks.FUTURE).sum()
        assert (
            counts[name][b] == (reasons[b] != 0).sum() - counts["padding"][b] - counts["future"][b]
        )
        assert sum(int(v[b]) for v in counts.values()) == batch.N**2


def test_a_long_windowed_sentence_is_summarized_with_its_counts():
    words = " ".join(f"w{i % 97}" for i in range(5000))
    r = _cli("masks", words, "--window", "4", "--json")
    assert r.returncode == 0, r.stderr
    comb = json.loads(r.stdout)["sentences"][0]["combined"]
    assert comb["summarized"] and comb["readable"] == 4 * 5000 - 6 and comb["window"] > 0


@pytest.mark.parametrize("args", [("--window", "0"), ("--chunk", "-2")])
def test_bad_rules_are_one_error_line(args):
    r = _cli("masks", "a b c", *args)
    assert (
        r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.splitlines()) == 1
    ), r.stderr
