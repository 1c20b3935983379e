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


def test_a_mask_with_no_window_is_not_named_a_window_off_by_k():
    """Plain causal against a window of 64: rows read back by differing amounts, so no one
    offset holds; the cells are named as read before the window's start."""
    theirs = torch.ones(256, 256).tril().bool()
    r = compare_masks(theirs, expected=Pattern(window=64))
    assert not r.ok and r.window_offset is None
    assert "window: 18528 cells read before the window's start" in r.message
    assert "off by" not in r.message
