"""What the checker's newer modules promise, each pinned by the behaviour that would break:
the one file reader on Fortran-ordered arrays, the isolation runner's nested deadlines and
process groups (in a capped subprocess), compare_masks' "window off by k" and its batch rows,
and diagnose's list of forms its probes could not test."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from causalattn import diagnose
from causalattn.check import CATALOGUE, compare_masks
from causalattn.io.files import read_arrays
from causalattn.masks import Pattern

sys.path.insert(0, str(Path(__file__).parents[1]))
from _helpers import peak_run  # noqa: E402
from faulty import more_faults, numpy_qkv, torch_qkv  # noqa: E402


# ---- io/files.py: Fortran order ----------------------------------------------------------
def _fortran_arrays():
    rng = np.random.default_rng(5)
    return {
        "Q": np.asfortranarray(rng.normal(size=(3, 5))),
        "cube": np.asfortranarray(rng.normal(size=(2, 3, 4)).astype(np.float32)),
    }


def test_a_fortran_ordered_npy_is_read_as_the_array_it_holds(tmp_path):
    for name, a in _fortran_arrays().items():
        assert a.flags.f_contiguous and not a.flags.c_contiguous
        path = tmp_path / f"{name}.npy"
        np.save(path, a)
        assert b"'fortran_order': True" in path.read_bytes()[:128]  # what is being tested
        got = next(iter(read_arrays(path, 2**20).values()))
        assert got.shape == a.shape and got.dtype == a.dtype
        np.testing.assert_array_equal(got, a)


def test_a_fortran_ordered_npz_member_is_read_as_the_array_it_holds(tmp_path):
    arrays = _fortran_arrays()
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, **arrays)
        got = read_arrays(path, 2**20)
        assert set(got) == set(arrays)
        for name, a in arrays.items():
            assert got[name].shape == a.shape and got[name].dtype == a.dtype
            np.testing.assert_array_equal(got[name], a)


# ---- io/runner.py: a run inside a run ------------------------------------------------------
# the outer job starts an inner run whose job starts a grandchild (`sleep`) and then hangs;
# the outer run's deadline is 3 s, the inner one asks for 60 s
_NESTED = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from causalattn.io import runner

    PIDS = sys.argv[1]

    def inner():
        child = subprocess.Popen(["sleep", "60"])
        with open(PIDS, "w") as fh:
            json.dump({"inner": os.getpid(), "grandchild": child.pid,
                       "inner_group": os.getpgid(0), "left": runner.remaining()}, fh)
        time.sleep(60)
        return "inner finished"

    def outer():
        with open(PIDS + ".outer", "w") as fh:
            json.dump({"outer": os.getpid(), "outer_group": os.getpgid(0)}, fh)
        return str(runner.run(inner, timeout=60, what="inner"))

    t0 = time.monotonic()
    got = runner.run(outer, timeout=3, what="outer")
    took = time.monotonic() - t0
    time.sleep(0.5)  # (the killed processes' parents reap them)
    print("@@" + json.dumps({"took": took, "kind": getattr(got, "kind", None), "got": str(got)}))
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            state = next(s for s in fh if s.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "Z" in state.split()[1]  # a zombie runs nothing


def test_an_inner_run_ends_with_its_outer_runs_deadline_grandchildren_included(tmp_path):
    pids = tmp_path / "pids.json"
    sys_argv = f"import sys; sys.argv[1:] = [{str(pids)!r}]\n"
    rc, out, _ = peak_run(sys_argv + _NESTED, timeout=60)
    assert rc == 0 and "@@" in out, out
    res = json.loads(out.split("@@", 1)[1].splitlines()[0])
    inner = json.loads(pids.read_text())
    outer = json.loads(Path(f"{pids}.outer").read_text())
    # the inner deadline was the outer one's remainder, not its own 60 s
    assert inner["left"] is not None and inner["left"] <= 3.0
    assert res["took"] < 10, res  # not 60 s: the inner run did not outlive the outer one
    # the inner worker stays in the outer worker's group, so the outer kill reaches it
    assert inner["inner_group"] == outer["outer_group"] == outer["outer"]
    for name in ("inner", "grandchild"):
        assert _gone(inner[name]), f"the {name} process {inner[name]} outlived the outer run"
    assert _gone(outer["outer"])


# ---- check/compare.py -------------------------------------------------------------------------
T_CMP, W = 48, 8


def _window_rows_shifted(shifts: dict[int, int]):
    """The window-W causal mask (1, 1, T, T) with row i reading up to ``shifts[i]`` keys
    further back than the window's start (as far as key 0 allows), and each bitten row's
    offset as made {row: k}."""
    m = torch.as_tensor(Pattern(window=W).allowed(1, 1, T_CMP, T_CMP)).clone()
    made = {}
    for i in range(W, T_CMP):  # the rows whose window starts after key 0
        lo = i - W + 1
        k = min(shifts.get(i, 0), lo)
        m[0, 0, i, lo - k : lo] = True
        made[i] = k
    return m, made


def _share(made: dict, k: int) -> float:
    return sum(v == k for v in made.values()) / len(made)


def test_window_off_by_k_is_named_when_the_offset_holds_on_three_quarters_of_the_rows():
    rows = list(range(W, T_CMP))
    # every bitten row reads 2 keys further back (the first one only 1: key 0): off by 2
    m, made = _window_rows_shifted({i: 2 for i in rows})
    got = compare_masks(m, Pattern(window=W))
    assert _share(made, 2) > 0.9
    assert got.window_offset == 2 and "window off by 2" in got.message, got.message
    # exactly three quarters by 2, the rest by other amounts: still off by 2
    n = len(rows)
    for n2, named in ((3 * n // 4, True), (3 * n // 4 - 1, False)):
        shifts = {i: (2 if r < n2 else 1) for r, i in enumerate(reversed(rows))}
        m, made = _window_rows_shifted(shifts)
        assert _share(made, 2) == n2 / n
        got = compare_masks(m, Pattern(window=W))
        assert not got.ok
        if named:
            assert got.window_offset == 2 and "window off by 2" in got.message, got.message
        else:  # below the share: no one offset holds, so no "window off by"
            assert got.window_offset is None and "window off by" not in got.message
            assert "window:" in got.message, got.message


def test_a_few_rows_reading_further_back_are_not_a_window_off_by_k():
    m, _ = _window_rows_shifted({20: 2, 30: 2, 40: 2})
    got = compare_masks(m, Pattern(window=W))
    assert not got.ok and got.window_offset is None
    assert "window off by" not in got.message and got.kinds == {"window": 6}


def test_every_batch_row_of_their_mask_is_compared():
    causal = torch.as_tensor(Pattern().allowed(1, 1, 16, 16))
    for bad_row in (0, 1, 2):
        theirs = causal.repeat(3, 1, 1, 1).clone()
        theirs[bad_row, 0, 9, 12] = True  # one future key read, in one batch row only
        got = compare_masks(theirs, Pattern())
        assert got.shape[0] == 3 and got.kinds == {"future key read": 1}, got.message
        assert got.differences[0].cells == ((bad_row, 0, 9, 12),)


def test_every_batch_row_of_the_expected_pattern_is_compared():
    # their one plain causal row against a pattern of two rows (lengths 10 and 6)
    theirs = torch.as_tensor(Pattern().allowed(1, 1, 10, 10))
    expected = Pattern(lengths=[10, 6])
    got = compare_masks(theirs, expected)
    assert got.shape[0] == 2 and not got.ok
    assert {c[0] for d in got.differences for c in d.cells} == {1}, got.message
    want = np.broadcast_to(expected.allowed(2, 1, 10, 10), (2, 1, 10, 10))
    assert sum(got.kinds.values()) == int((want[1] ^ theirs[0].numpy()).sum())
    # and each of their rows against the pattern's own row
    both = torch.as_tensor(np.array(want))
    assert compare_masks(both, expected).ok
    both[1, 0, 3, 1] = False
    got = compare_masks(both, expected)
    assert got.kinds == {"readable key blocked": 1}
    assert got.differences[0].cells == ((1, 0, 3, 1),)


# ---- diagnose: what it says it could not test -------------------------------------------------
# catalogue id -> a planted fault (tests/faulty) that a probe shows, and what it declares
SHOWN = {
    "causal-top-left": (more_faults.causal_top_left, {}),  # the decoding probe
    "k-not-transposed": (numpy_qkv.k_not_transposed, {}),  # the T = d_k probe
    "padding-ignored": (numpy_qkv.padding_ignored, {}),  # the padding probe
    "nan-on-empty-rows": (numpy_qkv.nan_on_empty_rows, {}),
    "finite-min-added-twice": (torch_qkv.finite_min_added_twice, {}),
    "window-off-by-one": (more_faults.window_off_by_one, {"window": 3}),
    "softmax-fp16-accumulation": (more_faults.softmax_fp16_accumulation, {}),
}


@pytest.mark.parametrize("fault", list(SHOWN))
def test_a_form_a_probe_that_ran_tested_is_not_listed_untested(fault):
    fn, declared = SHOWN[fault]
    d = diagnose(fn, **declared)
    assert d.fault == fault, str(d)  # a probe that ran tested it (and showed it) ...
    assert fault not in d.untested, (fault, d.untested, d.details.get("probes"))  # ... so


def _bottom_right(q, k, v):
    """Correct causal attention for T_q <= T_k (the queries are the last positions)."""
    Q, K, V = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    S = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    T_q, T_k = S.shape[-2:]
    S = np.where(np.tril(np.ones((T_q, T_k), bool), T_k - T_q), S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    return (A / A.sum(-1, keepdims=True)) @ V


def test_clean_code_lists_only_what_its_probes_could_not_test():
    d = diagnose(_bottom_right)
    assert d.status == "clean", str(d)
    ran = d.details["probes"]
    assert any(n.startswith("decoding") for n in ran) and "long fp16 rows" in ran
    assert "causal-top-left" not in d.untested  # the decoding probe ran
    assert "softmax-fp16-accumulation" not in d.untested
    assert "window-off-by-one" in d.untested  # no window declared: nothing tested it
    assert set(d.untested) <= {f.id for f in CATALOGUE}


def _same_length_only(q, k, v):
    """Correct causal attention that refuses T_q != T_k (so no decoding probe runs)."""
    Q, K, V = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if Q.shape[-2] != K.shape[-2]:
        raise ValueError("T_q must equal T_k")
    S = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    T = S.shape[-1]
    S = np.where(np.tril(np.ones((T, T), bool)), S, -np.inf)
    A = np.exp(S - S.max(-1, keepdims=True))
    return (A / A.sum(-1, keepdims=True)) @ V


def test_without_a_decoding_probe_the_top_left_form_is_listed_untested():
    d = diagnose(_same_length_only)
    assert not any(n.startswith("decoding") for n in d.details["probes"]), d.details
    assert "causal-top-left" in d.untested, (d.untested, d.details)
