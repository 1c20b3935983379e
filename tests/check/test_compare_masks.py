"""causalattn.check.compare_masks: someone's mask — dense bool, additive float, a
FlexAttention BlockMask or a mask_mod — against the Pattern meant. Each kind of difference
is named on planted masks, at small T in every input form and at T = 32768 in a subprocess
whose address space is capped below one T×T boolean mask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from causalattn.check import compare_masks
from causalattn.masks import Pattern

pytest.importorskip("torch.nn.attention.flex_attention")


def _dense(pattern: Pattern, T: int, B: int = 1) -> torch.Tensor:
    return torch.as_tensor(pattern.allowed(B, 1, T, T))


def _forms(allowed: torch.Tensor, T: int):
    """The same mask as a dense bool, an HF-style additive float, a mask_mod and a BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    A = allowed.reshape(-1, T, T)

    def theirs(b, h, q_idx, kv_idx):
        return A[b if A.shape[0] > 1 else 0, q_idx, kv_idx]

    additive = torch.zeros(A.shape, dtype=torch.float32).masked_fill(
        ~A, torch.finfo(torch.float32).min
    )
    bm = create_block_mask(
        theirs, A.shape[0] if A.shape[0] > 1 else None, None, T, T, device="cpu", BLOCK_SIZE=16
    )
    return {"bool": A, "additive": additive, "mask_mod": theirs, "block_mask": bm}


T = 64
# (what was meant, their mask: the meant one with one planted defect, the kind named)
PLANTED = {
    "future key read": (
        Pattern(),
        lambda a: a.index_put_((torch.tensor(3), torch.tensor(40)), torch.tensor(True)),
    ),
    "read across documents": (Pattern(cu_seqlens=[0, 30, 64]), None),
    "padding read": (Pattern(lengths=[50]), None),
    "chunk boundary crossed": (Pattern(chunk=16), None),
    "window": (Pattern(window=8), None),
    "readable key blocked": (
        Pattern(),
        lambda a: a.index_put_((torch.tensor(20), torch.tensor(5)), torch.tensor(False)),
    ),
}


def _theirs_for(kind: str) -> torch.Tensor:
    """Their (1, T, T) booleans: the meant pattern with the planted defect."""
    meant, plant = PLANTED[kind]
    if plant is not None:
        a = _dense(meant, T)[0, 0].clone()
        plant(a)
        return a[None]
    # the rule left out: plain causal, or a window 3 wider
    other = Pattern(window=11) if kind == "window" else Pattern()
    return _dense(other, T)[0, 0][None]


@pytest.mark.parametrize("form", ["bool", "additive", "mask_mod", "block_mask"])
@pytest.mark.parametrize("kind", list(PLANTED))
def test_each_planted_difference_is_named(kind, form):
    meant, _ = PLANTED[kind]
    theirs = _forms(_theirs_for(kind), T)[form]
    r = compare_masks(theirs, meant, T=T)
    assert not r.ok and not r
    kinds = {d.kind for d in r.differences}
    assert kind in kinds, r.message
    if kind == "window":
        assert r.window_offset == 3 and "window off by 3" in r.message
    if kind == "future key read":
        (d,) = r.differences
        assert d.count == 1 and d.cells == ((0, 0, 3, 40),)
        assert "query 3, key 40" in d.detail
    # their mask agrees with itself written as a Pattern's dense mask
    assert compare_masks(theirs, Pattern(causal=False, mask=_theirs_for(kind)), T=T).ok


def test_agreeing_masks_say_so_in_every_form():
    meant = Pattern(window=8, cu_seqlens=[0, 20, 64], chunk=16)
    for form, theirs in _forms(_dense(meant, T)[0, 0][None], T).items():
        r = compare_masks(theirs, meant, T=T)
        assert r.ok and r.differences == () and "agree" in r.message, (form, r.message)


def test_their_block_mask_for_another_length_is_named_before_any_cell():
    bm = Pattern().to_block_mask(48, 48, block_size=16)
    r = compare_masks(bm, Pattern(), T=T)
    assert not r.ok
    assert r.differences[0].kind == "length"
    assert "(48, 48)" in r.differences[0].detail and "(64, 64)" in r.differences[0].detail


def test_a_dense_mask_of_another_size_is_named():
    r = compare_masks(_dense(Pattern(), 32)[0, 0], Pattern(), T=T)
    assert not r.ok and r.differences[0].kind == "length" and "32×32" in r.message


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="expected must be a causalattn.masks.Pattern"):
        compare_masks(torch.ones(4, 4, dtype=torch.bool), expected="causal")
    with pytest.raises(ValueError, match="a mask_mod has no size of its own; give T"):
        compare_masks(lambda b, h, q, k: q >= k, Pattern())
    with pytest.raises(ValueError, match="dense mask needs 2 to 4 axes"):
        compare_masks(torch.ones(4, dtype=torch.bool), Pattern())
    # an integer 1/0 mask is read (1 = may read); values that fit no convention are not
    with pytest.raises(ValueError, match="ambiguous mask convention.*first at \\[0, 0\\] = 0.5"):
        compare_masks(torch.full((4, 4), 0.5), Pattern())
    with pytest.raises(ValueError, match="must be boolean .*, additive .* or 1/0"):
        compare_masks(torch.ones(4, 4, dtype=torch.complex64), Pattern())


def test_the_report_as_data_and_one_based_text():
    r = compare_masks(_theirs_for("future key read"), Pattern(), T=T)
    d = r.to_dict(base=1)
    assert d["ok"] is False and d["shape"] == [1, 1, T, T]
    assert d["differences"][0]["cells"] == [[0, 0, 4, 41]]
    assert "query 4, key 41" in r.format(base=1)


# ---- T = 32768, in bounded memory ------------------------------------------------------------
BIG = textwrap.dedent(
    r"""
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    from causalattn.check import compare_masks
    from causalattn.masks import Pattern
    from causalattn import masks_mod as mm
    from torch.nn.attention.flex_attention import BlockMask

    T, W, BS = 32768, 512, 128
    D = T // 2 + 100  # the second document's start (not on a chunk boundary)
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
    cap = vm * 1024 + (T * T) // 2  # half a T×T boolean mask beyond what is mapped now
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def planted(base, cells):
        # their BlockMask: `base`'s blocks and rule, plus the planted cells (their blocks partial)
        kinds = mm.tile_kinds(base, 1, 1, T, T, BS, BS)
        for i, j in cells:
            kinds[0, 0, i // BS, j // BS] = mm.PARTIAL_DENSE
        inner = mm.to_mask_mod(base, T, T)
        qi = torch.tensor([c[0] for c in cells]); kj = torch.tensor([c[1] for c in cells])

        def theirs(b, h, q_idx, kv_idx):
            extra = ((q_idx[..., None] == qi) & (kv_idx[..., None] == kj)).any(-1)
            return inner(b, h, q_idx, kv_idx) | extra

        n, i, fn, fi = mm._kv_blocks(kinds, "cpu")
        return BlockMask.from_kv_blocks(n, i, fn, fi, BLOCK_SIZE=(BS, BS), mask_mod=theirs,
                                        seq_lengths=(T, T))

    out = {}
    # meant: window + documents + chunks counted from each document's start; theirs: a
    # window 3 wider, chunks counted from the sequence start, no documents, one future key
    meant = Pattern(window=W, chunk=4096, cu_seqlens=[0, D, T])
    theirs = planted(Pattern(window=W + 3, chunk=4096), [(100, 5000)])
    r = compare_masks(theirs, meant)
    out["mixed"] = {"ok": r.ok, "kinds": r.kinds, "offset": r.window_offset, "message": r.message}
    r = compare_masks(planted(Pattern(window=W), []), Pattern(window=W, lengths=[T - 1000]))
    out["padding"] = {"ok": r.ok, "kinds": r.kinds, "message": r.message}
    r = compare_masks(planted(Pattern(window=W), []), Pattern(window=W))
    out["same"] = {"ok": r.ok, "message": r.message}
    r = compare_masks(planted(Pattern(window=W), []), Pattern(window=W), T=T + 64)
    out["length"] = {"ok": r.ok, "kinds": [d.kind for d in r.differences], "message": r.message}
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["cap_extra_mib"] = (T * T) // 2 / 2**20
    print(json.dumps(out))
    """
)


def test_compare_masks_names_each_kind_at_32768_in_bounded_memory():
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", BIG], capture_output=True, text=True, env=env, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    mixed = out["mixed"]
    assert not mixed["ok"]
    for kind in ("future key read", "read across documents", "chunk boundary crossed"):
        assert mixed["kinds"].get(kind, 0) > 0, mixed["message"]
    assert mixed["kinds"]["future key read"] == 1
    assert mixed["offset"] == 3 and mixed["message"].count("window off by 3") == 1
    # where their chunks (from the sequence start) block what the document's chunks read
    assert mixed["kinds"]["readable key blocked"] > 0
    assert not out["padding"]["ok"] and out["padding"]["kinds"].get("padding read", 0) > 0
    assert out["same"]["ok"], out["same"]["message"]
    assert not out["length"]["ok"] and out["length"]["kinds"][0] == "length"
    # under the cap (half of one 32768² boolean mask beyond the interpreter and torch)
    assert out["peak_mib"] < 2048, out


def test_a_narrower_window_is_named_as_off_by_minus_k():
    r = compare_masks(_dense(Pattern(window=5), T)[0, 0], Pattern(window=8), T=T)
    assert not r.ok and r.window_offset == -3
    (d,) = r.differences
    assert d.kind == "readable key blocked" and "window off by -3" in d.detail
    assert "their rows read the last 5 positions, the pattern's window is 8" in d.detail


def test_a_window_off_by_k_leaves_the_other_kinds_worded_as_themselves():
    """Their window 3 wider and one future key read: "window off by 3" for the window's
    cells; the future read keeps its own sentence."""
    theirs = _theirs_for("window").clone()
    theirs[0, 3, 40] = True
    _off_by(theirs, 3, "future key read", "future key read: 1 cells read a key after")


def _off_by(theirs, k: int, other: str, other_words: str) -> None:
    """Against a window of 8: their window k wider, worded so, and the one other kind with
    its own sentence."""
    r = compare_masks(theirs, Pattern(window=8), T=T)
    assert r.window_offset == k and set(r.kinds) == {"window", other}
    words = {d.kind: d.detail for d in r.differences}
    assert words["window"].startswith(f"window off by {k}: their rows read the last {8 + k} ")
    assert words[other].startswith(other_words)


def test_a_mask_with_no_window_is_not_named_a_window_off_by_k():
    """Plain causal against a window of 64: rows read back by differing amounts, so no one
    offset holds; the cells are named as read before the window's start."""
    theirs = torch.ones(256, 256).tril().bool()
    r = compare_masks(theirs, expected=Pattern(window=64))
    assert not r.ok and r.window_offset is None
    assert "window: 18528 cells read before the window's start" in r.message
    assert "off by" not in r.message


# ---- the answer's wording and data, block by block ------------------------------------------
def _rect_case():
    """Their (2, 1, 40, 56) window-11 mask with a padding key and a window cell planted,
    against a window-8 + chunk-16 + lengths (56, 45) pattern: T_q < T_k, two batch rows."""
    T_q, T_k = 40, 56
    a = np.broadcast_to(Pattern(window=11).allowed(2, 1, T_q, T_k), (2, 1, T_q, T_k))
    theirs = torch.as_tensor(np.array(a))
    theirs[1, 0, 5, 50] = True  # (row 1's keys from 45 on are padding)
    theirs[0, 0, 30, 2] = True
    return theirs, Pattern(window=8, chunk=16, lengths=[56, 45]), T_q, T_k


def _differing_cells(theirs: torch.Tensor, meant: Pattern) -> int:
    B, H, T_q, T_k = theirs.shape
    want = np.broadcast_to(meant.allowed(B, H, T_q, T_k), theirs.shape)
    return int((theirs.numpy() ^ want).sum())


@pytest.mark.parametrize("form", ["bool", "mask_mod", "block_mask"])
def test_the_answer_does_not_depend_on_the_block_or_the_form(form):
    """(2, 1, 40, 56): every form of the same mask, compared `block` × `block` cells at a
    time for blocks that cut BlockMask blocks (16) or not, gives the dense answer; and
    the counts add up to the cells that differ."""
    from torch.nn.attention.flex_attention import create_block_mask

    theirs, meant, T_q, T_k = _rect_case()
    A = theirs[:, 0]
    ref = compare_masks(theirs, meant)
    assert sum(ref.kinds.values()) == _differing_cells(theirs, meant)
    assert ref.shape == (2, 1, T_q, T_k) and not ref.ok
    forms = {
        "bool": theirs,
        # positions: the queries bottom-right (query i at position i + T_k - T_q)
        "mask_mod": lambda b, h, q, k: A[b, q - (T_k - T_q), k],
        # FlexAttention's own indices
        "block_mask": create_block_mask(
            lambda b, h, q, k: A[b, q, k], 2, None, T_q, T_k, device="cpu", BLOCK_SIZE=16
        ),
    }
    size = {"T_q": T_q, "T_k": T_k, **({"B": 2} if form == "mask_mod" else {})}  # (no B of its own)
    for block in (7, 16, 24, 1000):
        got = compare_masks(forms[form], meant, **size, block=block)
        assert got.kinds == ref.kinds and got.window_offset == ref.window_offset, block
        assert [(d.kind, d.cells) for d in got.differences] == [
            (d.kind, d.cells) for d in ref.differences
        ], block
        # their mask written as the pattern meant: agreement, whatever the block
        assert compare_masks(
            forms[form], Pattern(causal=False, mask=theirs), **size, block=block
        ).ok


def _off_window(T_: int) -> torch.Tensor:
    """Plain causal (T, T): no window of its own (named "window", not "off by k")."""
    return torch.ones(T_, T_, dtype=torch.bool).tril()


# kind -> (their mask, the pattern meant, the words its sentence says)
_BLOCKED = _off_window(T).clone()
_BLOCKED[10, 2] = False
WORDED = {
    "future key read": (
        lambda: _theirs_for("future key read"),
        Pattern(),
        "read a key after the query",
    ),
    "read across documents": (
        lambda: _theirs_for("read across documents"),
        PLANTED["read across documents"][0],
        "read another document",
    ),
    "padding read": (
        lambda: _theirs_for("padding read"),
        PLANTED["padding read"][0],
        "read a padding key or come from a padding query",
    ),
    "chunk boundary crossed": (
        lambda: _theirs_for("chunk boundary crossed"),
        PLANTED["chunk boundary crossed"][0],
        "read another chunk",
    ),
    "window": (lambda: _off_window(T), Pattern(window=8), "read before the window's start"),
    "readable key blocked": (
        lambda: _theirs_for("readable key blocked"),
        Pattern(),
        "the pattern reads are blocked",
    ),
    "mask": (lambda: _off_window(T), Pattern(mask=_BLOCKED), "read what the mask blocks"),
    "mask_mod": (
        lambda: _off_window(T),
        Pattern(mask_mod=lambda b, h, q, k: (q != 10) | (k != 2)),
        "read what the mask_mod blocks",
    ),
}


@pytest.mark.parametrize("kind", list(WORDED))
def test_each_kind_is_worded_with_its_count_and_first_cell(kind):
    """Each kind's sentence: its name, how many cells, what they did, where the first is
    (0-based in the data and the default text; ``base=1`` on the CLI)."""
    theirs, meant, words = WORDED[kind]
    r = compare_masks(theirs(), meant, T=T)
    (d,) = (d for d in r.differences if d.kind == kind)
    b, h, i, j = d.cells[0]
    assert d.cells == tuple(sorted(d.cells)) and len(d.cells) == min(d.count, 5)
    assert d.detail == d.describe() == d.to_dict()["detail"]
    assert d.detail.startswith(f"{kind}: {d.count} cells ") and words in d.detail, d.detail
    assert d.detail.endswith(f"(first at b={b}, h={h}, query {i}, key {j})"), d.detail
    assert f"(first at b={b}, h={h}, query {i + 1}, key {j + 1})" in d.describe(base=1)
    assert d.to_dict()["cells"][0] == [b, h, i, j] and d.to_dict()["kind"] == kind
    assert d.to_dict(base=1)["cells"][0] == [b, h, i + 1, j + 1]
    assert d.to_dict()["count"] == d.count == r.kinds[kind]
    assert "  " + d.detail in r.message.splitlines()


def test_the_comparison_as_data_counts_from_zero_unless_told():
    """to_dict() / format(): 0-based by default, ``base=1`` for the CLI; an agreement's
    text is its one line, whatever the base."""
    r = compare_masks(_theirs_for("window"), Pattern(window=8), T=T)
    d = r.to_dict()
    assert d["ok"] is False and d["shape"] == [1, 1, T, T] and d["convention"] == "bool"
    assert d["expected"] == r.expected == Pattern(window=8).describe()
    assert d["window_offset"] == r.window_offset == 3
    assert d["message"] == r.format() and [x["kind"] for x in d["differences"]] == ["window"]
    (diff,) = r.differences
    assert d["differences"][0]["cells"] == [list(c) for c in diff.cells]
    assert r.format().splitlines() == [r.message.splitlines()[0], "  " + diff.describe()]
    assert r.to_dict(base=1)["message"] == r.format(base=1) != r.format()
    b, h, i, j = diff.cells[0]
    assert r.to_dict(base=1)["differences"][0]["cells"][0] == [b, h, i + 1, j + 1]
    assert diff.describe().startswith("window off by 3: ") and diff.offset == 3
    assert diff.describe(base=1).startswith("window off by 3: ") and diff.window == 8
    ok = compare_masks(_off_window(T), Pattern(), T=T)
    assert ok.ok and ok.format(base=1) == ok.format() == ok.message
    assert ok.to_dict()["differences"] == [] and ok.window_offset is None


def test_how_their_dense_mask_was_read_is_said():
    """A dense mask's convention goes into the answer (and its text); a mask_mod has none."""
    allowed = _off_window(16)
    additive = torch.zeros(16, 16).masked_fill(~allowed, float("-inf"))
    for theirs, conv in ((allowed, "bool"), (additive, "additive"), (allowed.int(), "1/0")):
        r = compare_masks(theirs, Pattern())
        assert r.ok and r.convention == conv, r.message
        assert "agree on all 1×1×16×16 cells (causal; theirs read as " in r.message, r.message
    r = compare_masks(lambda b, h, q, k: q >= k, Pattern(), T=16)
    assert r.ok and r.convention is None and "read as" not in r.message
    assert r.message == "the masks agree on all 1×1×16×16 cells (causal)"


def test_the_sizes_compared_come_from_theirs_or_the_arguments():
    """(B, H, T_q, T_k): a dense mask's own axes, a BlockMask's tables and lengths, or B=,
    H=, T= / T_q= / T_k= (one of T_q, T_k stands for both)."""
    causal = lambda b, h, q, k: q >= k  # noqa: E731
    assert compare_masks(causal, Pattern(), T_q=12).shape == (1, 1, 12, 12)
    assert compare_masks(causal, Pattern(), T_k=12).shape == (1, 1, 12, 12)
    assert compare_masks(causal, Pattern(), T=12, B=2, H=3).shape == (2, 3, 12, 12)
    dense = torch.as_tensor(Pattern().allowed(1, 1, 8, 12)).repeat(2, 3, 1, 1)
    assert compare_masks(dense, Pattern()).shape == (2, 3, 8, 12)
    assert compare_masks(dense[0, 0], Pattern(), B=4, H=5).shape == (4, 5, 8, 12)
    from torch.nn.attention.flex_attention import create_block_mask

    bottom_right = lambda b, h, q, k: q + 16 >= k  # noqa: E731  (FlexAttention's indices)
    bm = create_block_mask(bottom_right, 2, 3, 24, 40, device="cpu", BLOCK_SIZE=8)
    r = compare_masks(bm, Pattern())
    assert r.ok and r.shape == (2, 3, 24, 40), r.message
    # one future key in head 2 of batch row 1 only: named at (1, 2, i, j), nowhere else
    late = lambda b, h, q, k: (q >= k) | ((b == 1) & (h == 2) & (q == 3) & (k == 9))  # noqa: E731
    r = compare_masks(late, Pattern(), T=12, B=2, H=3)
    assert r.kinds == {"future key read": 1} and r.differences[0].cells == ((1, 2, 3, 9),)


def test_their_dense_mask_of_another_size_names_both_sizes():
    r = compare_masks(_dense(Pattern(), 32)[0, 0], Pattern(), T_q=48, T_k=T)
    d = r.differences[0]
    assert d.kind == "length" and d.count == 0 and d.cells == ()
    assert d.detail == d.describe(base=1) == d.to_dict(base=1)["detail"]
    assert "their mask is 32×32 but the sequence is T_q×T_k = 48×64" in d.detail
    assert d.to_dict()["cells"] == [] and r.shape == (1, 1, 48, T)
    assert compare_masks(_dense(Pattern(), 32)[0, 0], Pattern(), T=32).ok  # the same size


def test_a_block_mask_whose_tables_do_not_fit_its_block_size_is_named():
    """(64, 64) at BLOCK_SIZE 16 needs 4×4 blocks; tables of 2×2 (or 4×2) are named, and
    no cell is judged (the tables cannot say what the missing blocks read)."""
    from torch.nn.attention.flex_attention import BlockMask

    for nq, nk in ((2, 2), (4, 2), (2, 4)):
        num = torch.full((1, 1, nq), nk, dtype=torch.int32)
        idx = torch.arange(nk, dtype=torch.int32).expand(1, 1, nq, nk).contiguous()
        bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(64, 64))
        r = compare_masks(bm, Pattern())
        assert not r.ok and [d.kind for d in r.differences] == ["block size"], r.message
        (d,) = r.differences
        assert d.count == 0 and d.cells == () and d.to_dict()["cells"] == []
        assert d.describe(base=1) == d.detail
        assert r.kinds == {} and r.window_offset is None
        assert (
            f"BLOCK_SIZE (16, 16) needs 4×4 blocks for (64, 64), but its tables hold {nq}×{nk}"
            in r.message
        ), r.message
    # (32, 64) at 16: 2×4 blocks needed; tables of 1×2, rows and columns each in their place
    num = torch.full((1, 1, 1), 2, dtype=torch.int32)
    idx = torch.arange(2, dtype=torch.int32).reshape(1, 1, 1, 2)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(32, 64))
    r = compare_masks(bm, Pattern())
    assert "needs 2×4 blocks for (32, 64), but its tables hold 1×2" in r.message, r.message
    # tables that fit: no such difference
    assert compare_masks(Pattern().to_block_mask(64, 64, block_size=16), Pattern()).ok


def test_a_block_mask_for_another_length_is_one_difference_with_no_cells():
    bm = Pattern().to_block_mask(48, 48, block_size=16)
    r = compare_masks(bm, Pattern(), T=T)
    d = r.differences[0]
    assert d.kind == "length" and d.count == 0 and d.cells == () and d.to_dict()["cells"] == []
    assert d.describe(base=1) == d.detail and d.detail in r.format(base=1)
    assert "it would mask the wrong cells or be cut" in d.detail


def test_a_block_mask_of_one_batch_row_stands_for_every_row():
    """Their BlockMask (B=1) against a pattern of two batch rows (lengths 64, 50): each
    row is compared, the second's padding named there."""
    bm = Pattern().to_block_mask(64, 64, block_size=16)
    for block in (16, 1024):
        r = compare_masks(bm, Pattern(lengths=[64, 50]), block=block)
        assert r.shape == (2, 1, 64, 64) and list(r.kinds) == ["padding read"], r.message
        assert {c[0] for c in r.differences[0].cells} == {1}
        assert r.kinds["padding read"] == _differing_cells(
            torch.as_tensor(Pattern().allowed(1, 1, 64, 64)).repeat(2, 1, 1, 1),
            Pattern(lengths=[64, 50]),
        )


def test_a_block_mask_at_queries_past_its_own_reads_nothing_there():
    """A BlockMask of (32, 64) read at query positions 40..71 (q_start=40): FlexAttention's
    query i is position i + 32, so rows 0..23 read keys up to their position and rows
    24..31 (its queries 32..39: not in it) read nothing, whatever the block."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(
        lambda b, h, q, k: q + 32 >= k, None, None, 32, 64, BLOCK_SIZE=16, device="cpu"
    )
    pos = torch.arange(32)[:, None] + 40
    reads = (torch.arange(64)[None, :] <= pos) & (pos < 64)
    meant = Pattern(causal=False, mask=reads, q_start=40)
    for block in (8, 24, 1024):
        r = compare_masks(bm, meant, T_q=32, T_k=64, block=block)
        assert r.ok, (block, r.message)


def test_a_block_mask_for_a_shorter_length_is_judged_on_every_cell():
    """Their full (bidirectional) BlockMask for (48, 48) against causal at T = 64: past its
    own length it reads nothing; within it, its 48·47/2 future reads are each counted, and
    the causal rows 48..63 it does not read (49 + ... + 64 keys) too, whatever the block."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(
        lambda b, h, q, k: q >= 0, None, None, 48, 48, device="cpu", BLOCK_SIZE=16
    )
    for block in (16, 32, 1024):
        r = compare_masks(bm, Pattern(), T=T, block=block)
        assert r.kinds == {"future key read": 48 * 47 // 2, "readable key blocked": 904}, block
        assert r.differences[0].kind == "length"


def test_a_pattern_that_does_not_fit_the_sizes_is_refused_by_name():
    with pytest.raises(ValueError, match=r"compare_masks: expected: lengths: .*\(3,\)"):
        compare_masks(torch.ones(3, 1, 10, 10, dtype=torch.bool).tril(), Pattern(lengths=[10, 6]))


# ---- a lone mask (audit's door) ---------------------------------------------------------------
def test_a_lone_mask_is_one_array_boolean_or_named_like_a_mask(tmp_path):
    """lone_mask: a mapping or file of exactly one array of 2 to 4 axes that is boolean
    (NumPy or torch) or named like a mask (any case) is the mask; anything else is None."""
    from causalattn.check.compare import lone_mask

    causal = Pattern().allowed(1, 1, 6, 6)[0, 0]
    for m in (causal, torch.as_tensor(causal), causal[None], causal[None, None], causal.tolist()):
        got = lone_mask({"anything": m if not isinstance(m, list) else np.asarray(m)}, 10**6)
        assert got is not None and tuple(got.shape) == np.shape(m)
    t = torch.as_tensor(causal)
    assert lone_mask({"x": causal}, 10**6) is causal and lone_mask({"x": t}, 10**6) is t  # as given
    floats = causal.astype(np.float32)
    for name in ("mask", "Attention_Mask", "attn_mask", "allowed", "causal_mask"):
        assert lone_mask({name: floats}, 10**6) is floats
    assert lone_mask({"mask": floats.tolist()}, 10**6).shape == (6, 6)  # a list: as an array
    for obj in (
        {"scores": floats},  # not boolean, not named like a mask
        {"mask": floats[0]},  # 1 axis
        {"mask": floats[None, None, None]},  # 5 axes
        {"mask": floats, "q": floats},  # more than one array
        {},
    ):
        assert lone_mask(obj, 10**6) is None, obj
    # a file: the same test, on its headers
    np.save(tmp_path / "mask.npy", floats)
    np.save(tmp_path / "scores.npy", floats)
    np.save(tmp_path / "whatever.npy", causal)
    np.savez(tmp_path / "two.npz", mask=causal, q=floats)
    np.save(tmp_path / "row.npy", causal[0])
    np.testing.assert_array_equal(lone_mask(tmp_path / "mask.npy", 10**6), floats)
    np.testing.assert_array_equal(lone_mask(tmp_path / "whatever.npy", 10**6), causal)
    for name in ("scores.npy", "two.npz", "row.npy"):
        assert lone_mask(tmp_path / name, 10**6) is None, name


def test_a_lone_mask_is_compared_with_the_pattern_declared(tmp_path):
    """compare_lone_mask: the mask against Pattern(**declared); None for what is not a lone
    mask; every refusal an AuditInputError (compare_masks' own ones say audit)."""
    from causalattn.check.compare import compare_lone_mask
    from causalattn.io.files import AuditInputError

    causal = Pattern().allowed(1, 1, 16, 16)[0, 0]
    assert compare_lone_mask({"mask": causal}, 10**6, {}).ok
    r = compare_lone_mask({"mask": causal}, 10**6, {"window": 4})
    assert not r.ok and "causal + window 4 expected" in r.message and r.kinds["window"] > 0
    assert compare_lone_mask({"q": causal.astype(float)}, 10**6, {}) is None
    np.save(tmp_path / "mask.npy", causal)
    assert compare_lone_mask(tmp_path / "mask.npy", 10**6, {}).ok
    with pytest.raises(AuditInputError, match="^audit: .*ambiguous mask convention"):
        compare_lone_mask({"mask": np.full((4, 4), 0.5)}, 10**6, {})
    with pytest.raises(AuditInputError, match="^audit: .*window"):
        compare_lone_mask({"mask": causal}, 10**6, {"window": -1})
    # the file reader's own refusal goes through as it is (it names the file)
    with pytest.raises(AuditInputError, match="^[^ ]*mask.npy: .*above the limit of 100 bytes"):
        compare_lone_mask(tmp_path / "mask.npy", 100, {})  # 256 bytes of mask


def test_each_refusal_is_its_whole_message():
    """The refusals name the argument and the shape in full (re.search would pass a message
    with words around it or parts missing)."""

    def refusal(call) -> str:
        with pytest.raises(ValueError) as err:
            call()
        return str(err.value)

    assert refusal(
        lambda: compare_masks(torch.ones(4, 4, dtype=torch.bool), expected="causal")
    ) == ("compare_masks: expected must be a causalattn.masks.Pattern, got str")
    assert refusal(lambda: compare_masks(lambda b, h, q, k: q >= k, Pattern())) == (
        "compare_masks: a mask_mod has no size of its own; give T (or T_q and T_k)"
    )
    for shape in ((4,), (1, 1, 1, 4, 4)):
        assert refusal(
            lambda s=shape: compare_masks(torch.ones(s, dtype=torch.bool), Pattern())
        ) == (
            f"compare_masks: a dense mask needs 2 to 4 axes (B|1, H|1, T_q, T_k), got shape {shape}"
        )
    assert refusal(lambda: compare_masks(torch.full((4, 4), 0.5), Pattern())).startswith(
        "their mask: ambiguous mask convention, not judged: "
    )


def test_without_expected_the_mask_is_compared_with_plain_causal():
    """expected defaults to Pattern(): a lower triangle agrees, a full mask reads the future."""
    assert compare_masks(torch.ones(4, 4, dtype=torch.bool).tril()).ok
    full = compare_masks(torch.ones(4, 4, dtype=torch.bool))
    assert not full.ok and full.kinds == {"future key read": 6}
    assert full.expected == "causal"


# ---- sizes, placements and rows that the tiles must not get wrong ---------------------------
@pytest.mark.parametrize("size, mask_shape", [((8, 8), (6, 6)), ((8, 8), (2, 2)), ((4, 5), (2, 5))])
def test_a_dense_mask_smaller_than_the_sequence_is_judged_the_same_whatever_the_block(
    size, mask_shape
):
    """Their dense causal mask shorter than (T_q, T_k): the length is named, and past its
    own rows and keys it reads nothing; every cell that differs is counted, whatever the
    block (blocks that cut the mask's edge included)."""
    T_q, T_k = size
    mine = torch.as_tensor(Pattern().allowed(1, 1, *mask_shape)[0, 0])
    padded = torch.zeros(T_q, T_k, dtype=torch.bool)
    padded[: mask_shape[0], : mask_shape[1]] = mine
    n = _differing_cells(padded[None, None], Pattern())
    for block in (1, 2, 3, 4, 5, 8, 1024):
        r = compare_masks(mine, Pattern(), T_q=T_q, T_k=T_k, block=block)
        assert r.differences[0].kind == "length", block
        assert sum(r.kinds.values()) == n, block


def test_a_mask_mod_is_read_at_the_patterns_placed_positions():
    """A Pattern placed at keys 10.. (k_start=10, queries bottom-right: 10..17): their
    mask_mod is asked at those positions, so an absolute causal rule agrees."""
    theirs = lambda b, h, q, k: k <= q  # noqa: E731
    assert compare_masks(theirs, Pattern(k_start=10), T=8).ok
    r = compare_masks(lambda b, h, q, k: k <= q - 10, Pattern(k_start=10), T=8)
    assert set(r.kinds) == {"readable key blocked"} and r.kinds["readable key blocked"] == 36


def test_a_block_mask_of_whole_blocks_is_read_at_its_own_rows_when_t_q_is_shorter():
    """(T_q, T_k) = (32, 64), documents of 16 keys: every block of the BlockMask is full or
    empty, so its kinds alone give its cells; FlexAttention's query i is position i + 32."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(
        lambda b, h, q, k: (q + 32) // 16 == k // 16,
        None,
        None,
        32,
        64,
        BLOCK_SIZE=16,
        device="cpu",
    )
    pos = torch.arange(32)[:, None] + 32
    reads = pos // 16 == torch.arange(64)[None, :] // 16
    for block in (8, 16, 24, 1024):
        r = compare_masks(bm, Pattern(causal=False, mask=reads), T_q=32, T_k=64, block=block)
        assert r.ok, (block, r.message)


def test_rows_that_read_nothing_say_nothing_of_the_window():
    """Their window 2 wider than 8, and rows 40..63 read nothing: the offset is measured on
    the rows that read (+2 on all of them); the blocked rows keep their own sentence."""
    theirs = _dense(Pattern(window=10), T)[0, 0].clone()
    theirs[40:] = False
    _off_by(theirs, 2, "readable key blocked", "readable key blocked: 192 cells the ")


def test_a_window_that_bites_one_row_is_measured_on_that_row():
    """T = window + 1: only the last row's window starts after key 0; plain causal reads
    that key too, so their rows read one position further back."""
    r = compare_masks(torch.ones(9, 9).tril().bool(), Pattern(window=8))
    assert r.window_offset == 1 and r.kinds == {"window": 1}
    assert r.differences[0].detail.startswith("window off by 1: their rows read the last 9 ")


def test_a_per_head_rule_names_the_cells_each_head_blocks():
    """Head 1 of the pattern reads only even keys (a mask_mod reading h); plain causal
    theirs reads its odd keys: those cells are the mask_mod's, on head 1 only."""
    rule = lambda b, h, q, k: (h == 0) | (k % 2 == 0)  # noqa: E731
    theirs = torch.ones(1, 2, 6, 6).tril().bool()
    r = compare_masks(theirs, Pattern(mask_mod=rule))
    assert r.kinds == {"mask_mod": 9} and {c[1] for c in r.differences[0].cells} == {1}


def test_a_lone_mask_may_be_any_array_like():
    """An object with a shape and __array__ but no dtype (a table type, say) is read as
    the array it gives."""
    from causalattn.check.compare import lone_mask

    causal = Pattern().allowed(1, 1, 4, 4)[0, 0]

    class Grid:
        shape = (4, 4)

        def __array__(self, dtype=None, copy=None):
            return causal

    got = lone_mask({"mask": Grid()}, 10**6)
    np.testing.assert_array_equal(got, causal)


def test_a_bfloat16_additive_mask_is_read_as_its_values():
    """HF keeps additive masks in the model's dtype: a bfloat16 one (which NumPy lacks)."""
    allowed = torch.ones(T, T).tril().bool()
    additive = torch.zeros(T, T, dtype=torch.bfloat16).masked_fill(
        ~allowed, torch.finfo(torch.bfloat16).min
    )
    assert compare_masks(additive, Pattern()).ok


def test_the_differences_are_listed_by_their_first_cell_and_the_message_has_a_line_each():
    """One tile: their blocked cell (1, 0) comes before their future read (5, 6) in row
    order, though the future read is found first; a size difference (no cells) leads."""
    theirs = torch.ones(8, 8).tril().bool()
    theirs[1, 0], theirs[5, 6] = False, True
    r = compare_masks(theirs, Pattern())
    assert [d.kind for d in r.differences] == ["readable key blocked", "future key read"]
    head = "the masks differ (causal expected; theirs read as bool (True = may read)):\n"
    assert r.message == head + "\n".join("  " + d.detail for d in r.differences)
    wide = torch.zeros(8, 9, dtype=torch.bool)
    wide[:, :8] = torch.ones(8, 8).tril().bool()
    wide[2, 3] = True
    r = compare_masks(wide, Pattern(), T=8)
    assert [(d.kind, d.count) for d in r.differences] == [("length", 0), ("future key read", 1)]
