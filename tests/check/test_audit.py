"""The in-order audit: planted faults land at the right stage, clean traces pass, bad files exit
2."""

from __future__ import annotations

import json
import pickle
import zipfile

import numpy as np
import pytest
from typer.testing import CliRunner

import causalattn
from causalattn import masks
from causalattn.check import AuditInputError, audit
from causalattn.cli import app

T, D, DK = 6, 4, 3


@pytest.fixture(scope="module")
def parts():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(T, D))
    W = {n: rng.normal(size=(D, DK)) for n in ("W_q", "W_k", "W_v")}
    W["W_o"] = rng.normal(size=(DK, D))
    return X, W


def _softmax(Z, axis):
    with np.errstate(invalid="ignore"):  # a row of -inf gives NaN, as plain code would
        Z = Z - np.max(Z, axis=axis, keepdims=True)
        E = np.exp(Z)
        return E / E.sum(axis=axis, keepdims=True)


def _pipeline(X, W, *, scale=None, mask="causal", axis=-1, after=False):
    """Plain NumPy attention with one knob per planted fault -> dict of stages."""
    Q, K, V = X @ W["W_q"], X @ W["W_k"], X @ W["W_v"]
    S = Q @ K.T * (1 / np.sqrt(DK) if scale is None else scale)
    al = {
        "causal": masks.causal(T),
        "none": np.ones((T, T), bool),
        "diag": np.tril(np.ones((T, T), bool), -1),
    }[mask]
    if after:
        A = _softmax(S, -1) * al
    elif axis is None:
        Z = np.where(al, S, -np.inf)
        E = np.exp(Z - Z.max())
        A = E / E.sum()
    else:
        A = _softmax(np.where(al, S, -np.inf), axis)
    H = A @ V
    return {"X": X, **W, "Q": Q, "K": K, "V": V, "S": S, "A": A, "H": H, "O": H @ W["W_o"]}


def test_clean_trace_and_chapter_example(parts):
    X, W = parts
    rep = audit(causalattn.trace(X, *W.values()))
    assert rep.ok and rep.first_failure is None, str(rep)
    chapter = causalattn.trace(
        np.array([[1, 0], [0, 1], [1, 1], [-1, 1.0]]),
        np.eye(2),
        np.eye(2),
        np.array([[1, 1], [1, -1.0]]),
    )
    assert audit(chapter).ok
    assert audit(_pipeline(X, W)).ok
    d = audit(_pipeline(X, W)).to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON, nothing lost on the way
    assert d["ok"] and d["first_failure"] is None


@pytest.mark.parametrize(
    "knob, stage, hint",
    [
        ({"axis": 0}, "A", "query axis"),
        ({"axis": None}, "A", "all entries"),
        ({"after": True}, "A", "after softmax"),
        ({"scale": 1.0}, "S", "scale is missing"),
        ({"scale": 1.0 / DK}, "S", "divided by d_k"),
        ({"mask": "diag"}, "M", "diagonal is blocked"),
        ({"mask": "none"}, "M", "no causal mask"),
    ],
)
def test_planted_fault_at_its_stage(parts, knob, stage, hint):
    X, W = parts
    stages = _pipeline(X, W, **knob)
    rep = audit(stages)
    assert not rep.ok
    assert rep.first_failure.stage == stage, str(rep)
    assert hint in rep.first_failure.hint
    assert rep.first_failure.evidence
    # the same fault seen from fewer stages: A alone is recomputed from
    small = {k: stages[k] for k in ("X", "W_q", "W_k", "W_v", "A")}
    rep2 = audit(small)
    assert rep2.first_failure.stage == stage, str(rep2)
    assert {"Q", "K", "V", "S", "H"} <= set(rep2.recomputed)


def _check(rep, name):
    (c,) = [c for c in rep.checks if c.name == name]
    return c


def test_tiny_weight_on_a_blocked_key_is_caught(parts):
    """ "Forbidden entries exactly 0" means exactly: 1e-7 on each future key (taken from the
    diagonal so rows still sum to 1, H recomputed) fails the check."""
    X, W = parts
    st = _pipeline(X, W)
    A = st["A"].copy()
    future = ~masks.causal(T)
    A[future] = 1e-7
    A[np.diag_indices(T)] -= 1e-7 * future.sum(-1)
    st = {**st, "A": A, "H": A @ st["V"], "O": A @ st["V"] @ W["W_o"]}
    rep = audit(st)
    forb = _check(rep, "forbidden entries exactly 0")
    assert not forb.ok, str(rep)
    assert f"{int(future.sum())} blocked entries" in forb.message


@pytest.mark.parametrize("stage", ["S", "H"])
def test_a_float64_error_of_one_in_ten_thousand_is_caught(parts, stage):
    """The float64 tolerance is tight: a relative error of 1e-4 in one entry of S or H
    fails that stage."""
    X, W = parts
    st = _pipeline(X, W)
    x = st[stage].copy()
    x[3, 1] += 1e-4 * np.abs(x[np.isfinite(x)]).max()
    rep = audit({**st, stage: x})
    assert not rep.ok and rep.first_failure.stage == stage, str(rep)


def test_k_not_transposed_and_output_projection(parts):
    rng = np.random.default_rng(1)
    Q, K, V = rng.normal(size=(3, 4, 4))  # T = d_k, so Q K has the right shape
    S = Q @ K / 2.0
    rep = audit({"Q": Q, "K": K, "V": V, "S": S})
    assert rep.first_failure.stage == "S" and "not transposed" in rep.first_failure.hint
    X, W = parts
    st = _pipeline(X, W)
    Wsq = rng.normal(size=(DK, DK))
    rep = audit({**st, "W_o": Wsq, "O": st["H"] @ Wsq.T})
    assert rep.first_failure.stage == "O" and "transposed" in rep.first_failure.hint
    rep = audit({**st, "O": st["H"]})
    assert rep.first_failure.stage == "O" and "missing" in rep.first_failure.hint


def test_padding_rows_listed_not_failed_and_nan_rows_fail(parts):
    X, W = parts
    Xb = np.stack([X, X])
    al = masks.combine(
        masks.causal(T),
        masks.key_padding([T, 4], T)[:, None, :],
        masks.query_padding([T, 4], T)[:, :, None],
    )
    tr = causalattn.trace(Xb, *W.values(), mask=al, causal=False)
    rep = audit(tr)
    assert rep.ok, str(rep)
    assert rep.empty_rows == [{"index": [1], "rows": [4, 5]}]
    A = tr.A.copy()
    A[1, 4:] = np.nan
    rep = audit({"A": A, "V": tr.V, "allowed": al})
    assert rep.first_failure.stage == "A" and "NaN" in rep.first_failure.message
    assert rep.first_failure.evidence["index"] == (1,)
    # padding keys readable by real queries (declared lengths): fails at M
    rep = audit({"A": causalattn.trace(Xb, *W.values()).A, "lengths": np.array([T, 4])})
    assert not rep.ok and rep.first_failure.stage == "M", str(rep)


def test_torch_dump_audits(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    s = q @ k.transpose(-2, -1) / 2.0
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    a = torch.softmax(s, dim=-1)
    h = a @ v
    path = tmp_path / "torch.npz"
    np.savez(
        path, q=q.numpy(), k=k.numpy(), v=v.numpy(), scores=s.numpy(), attn=a.numpy(), out=h.numpy()
    )
    rep = audit(path)
    assert rep.ok, str(rep)
    assert "Z" in rep.given  # scores carrying -inf are read as Z = S + M
    rep = audit({"q": q, "k": k, "v": v, "pattern": torch.softmax(s, dim=-2).nan_to_num()})
    assert rep.first_failure.stage == "A"


def test_transformerlens_shaped_dict():
    rng = np.random.default_rng(2)
    b, pos, h, d = 2, 5, 3, 4
    q, k, v = rng.normal(size=(3, b, pos, h, d))
    qh, kh, vh = (np.moveaxis(x, 2, 1) for x in (q, k, v))
    s = qh @ np.swapaxes(kh, -1, -2) / np.sqrt(d)
    s = np.where(masks.causal(pos), s, -np.inf)
    p = _softmax(s, -1)
    z = np.moveaxis(p @ vh, 1, 2)  # (batch, pos, head, d)
    pre = "blocks.0.attn."
    cache = {
        pre + "hook_q": q,
        pre + "hook_k": k,
        pre + "hook_v": v,
        pre + "hook_attn_scores": s,
        pre + "hook_pattern": p,
        pre + "hook_z": z,
    }
    rep = audit(cache)
    assert rep.ok, str(rep)
    bad = p.copy()
    bad[1, 2] = np.nan_to_num(_softmax(s[1, 2], 0))
    rep = audit({**cache, pre + "hook_pattern": bad})
    assert rep.first_failure.stage == "A"
    assert rep.first_failure.evidence["index"] == (1, 2)
    with pytest.raises(AuditInputError, match="several layers"):
        audit({**cache, "blocks.1.attn.hook_q": q})


def test_folder_and_safetensors(tmp_path, parts):
    X, W = parts
    st = _pipeline(X, W, scale=1.0)
    folder = tmp_path / "arrays"
    folder.mkdir()
    for name in ("Q", "K", "V", "S"):
        np.save(folder / f"{name}.npy", st[name])
    assert audit(folder).first_failure.stage == "S"
    sf = pytest.importorskip("safetensors.numpy")
    sf.save_file(
        {"Q": st["Q"], "K": st["K"], "weights": _pipeline(X, W)["A"]},
        str(tmp_path / "a.safetensors"),
    )
    assert audit(tmp_path / "a.safetensors").ok


def _malformed(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, A=np.eye(3))
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(good.read_bytes()[:60])
    obj = tmp_path / "obj.npz"
    with zipfile.ZipFile(obj, "w") as zf:
        with zf.open("A.npy", "w") as fh:
            np.lib.format.write_array(fh, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    pkl = tmp_path / "pickle.npz"
    pkl.write_bytes(pickle.dumps({"A": np.eye(3)}))
    rank = tmp_path / "rank.npz"
    np.savez(rank, S=np.ones(4))
    nan = tmp_path / "nan.npz"
    np.savez(nan, A=np.full((4, 4), np.nan), V=np.full((4, 2), np.nan))
    empty = tmp_path / "empty.npz"
    np.savez(empty, tokens=np.array(["a", "b"]))
    return [trunc, obj, pkl, rank, nan, empty, tmp_path / "missing.npz"]


def test_cli_exit_codes(tmp_path, parts):
    runner = CliRunner()
    X, W = parts
    clean, bad = tmp_path / "clean.npz", tmp_path / "bad.npz"
    np.savez(clean, **_pipeline(X, W))
    np.savez(bad, **_pipeline(X, W, axis=0))
    r = runner.invoke(app, ["audit", str(clean)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["audit", str(bad), "--json"])
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert data["first_failure"]["stage"] == "A" and "query axis" in data["first_failure"]["hint"]
    for path in _malformed(tmp_path):
        r = runner.invoke(app, ["audit", str(path)])
        assert r.exit_code == 2, (path.name, r.output)
        assert "error:" in r.output and "Traceback" not in r.output, r.output
    r = runner.invoke(app, ["audit", str(clean), "--max-bytes", "100"])
    assert r.exit_code == 2 and "limit" in r.output


def test_heads_per_head_selection_decode_and_rendering(parts):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(2, 5, 8))
    W = [rng.normal(size=(8, 8)) for _ in range(4)]
    tr = causalattn.trace(X, *W, n_heads=2)
    assert audit(tr).ok and audit(tr.select(1)).ok
    rep = audit(tr.select(1, 1))  # one head: Q is found as head 1 of X W_q
    assert rep.ok and "head 1" in rep.checks[0].message
    # only X, weights and O: everything between is recomputed, heads split and merged
    rep = audit(
        {"X": X, "W_q": W[0], "W_k": W[1], "W_v": W[2], "W_o": W[3], "O": tr.O, "n_heads": 2}
    )
    assert rep.ok and {"Q", "S", "A", "H"} <= set(rep.recomputed)
    # decoding against a cache: T_q < T_k, bottom-right causal alignment
    q, k, v = rng.normal(size=(2, 4)), rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    s = q @ k.T / 2
    A = _softmax(np.where(masks.causal(2, 6), s, -np.inf), -1)
    assert audit({"Q": q, "K": k, "V": v, "A": A, "H": A @ v}).ok
    bad = audit({"Q": q, "K": k, "V": v, "A": A[:, :2]})
    assert bad.first_failure.stage == "A" and "S" in bad.first_failure.name
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(bad)
    text = console.export_text()
    assert "FAILED" in text and "hint" in text


def _padded_trace(X, W):
    """Two sequences of T, the second padded from 4 on: rows 4, 5 of it read no key."""
    Xb = np.stack([X, X])
    lengths = [T, 4]
    al = masks.Pattern(lengths=lengths).allowed(2, 1, T, T)[:, 0]
    return causalattn.trace(Xb, *W.values(), mask=al, causal=False), al, lengths


@pytest.mark.parametrize("value", [0.5, -1e-3, 1e-12, np.nan, np.inf])
@pytest.mark.parametrize("declared", ["allowed", "lengths"])
def test_a_padding_row_that_is_not_zero_fails_at_H(parts, value, declared):
    """Rows with no readable key are zero rows: any other value there, finite or not, is a
    failure at H (not only NaN), where H = A V holds on every readable row."""
    tr, al, lengths = _padded_trace(*parts)
    given = {"allowed": al} if declared == "allowed" else {"lengths": np.array(lengths)}
    base = {"X": tr.X, **{n: tr[n] for n in ("W_q", "W_k", "W_v")}, "A": tr.A, "H": tr.H}
    assert audit({**base, **given}).ok
    H = tr.H.copy()
    H[1, 4, 0] = value
    rep = audit({**base, "H": H, **given})
    ff = rep.first_failure
    assert ff is not None and ff.stage == "H", str(rep)
    assert ff.name == "rows with no readable key are zero", str(rep)
    assert ff.message == "1 rows with no readable key are not zero"
    assert ff.evidence["index"] == (1,) and "never NaN" in ff.hint, ff.evidence
    H[1, 5] = value  # both padding rows: two rows counted
    ff = audit({**base, "H": H, **given}).first_failure
    assert ff.stage == "H" and ff.message.startswith("2 rows"), ff.message


@pytest.mark.parametrize("declared", [False, True])
def test_padding_query_rows_may_read_a_subset_of_the_real_keys(parts, declared):
    """A padding query row reads nothing, or (key-padding-only style, as HF's masks do) any
    subset of the real keys before it: reading token 0 alone passes stage M. Reading a
    padding key, a real row reading less than causal allows, or a padding row reading
    nothing but a padding key fail there."""
    X, W = parts
    Xb = np.stack([X, X])
    lengths = np.array([T, 4])
    base = masks.Pattern(lengths=lengths).allowed(2, 1, T, T)[:, 0]
    kw = {"lengths": lengths} if declared else {}

    def structure(al):
        tr = causalattn.trace(Xb, *W.values(), mask=al, causal=False)
        rep = audit({"A": tr.A, "V": tr.V, "H": tr.H, "allowed": al, **kw})
        (c,) = [c for c in rep.checks if c.name == "mask is causal (+ padding)"]
        return rep, c

    for rows in ([4], [5], [4, 5]):
        al = base.copy()
        al[1, rows, 0] = True  # the padding rows read token 0 only
        rep, c = structure(al)
        assert c.ok and rep.ok, str(rep)
    al = base.copy()
    al[1, 4:, :3] = True  # a subset of the real keys 0..3
    assert structure(al)[1].ok
    al = base.copy()
    al[1, 5, :4] = True  # all the real keys: the causal-and-padding row
    assert structure(al)[1].ok
    al = base.copy()
    al[1, 2, 0] = False  # a real row that leaves out a key it may read
    rep, c = structure(al)
    assert not c.ok and rep.first_failure.stage == "M"
    if declared:
        al = base.copy()
        al[1, 5, [0, 4]] = True  # a padding row that reads a padding key (declared)
        rep, c = structure(al)
        assert not c.ok and "padding keys are readable" in c.hint, str(rep)


# ---- stages H, C and O, check by check ----------------------------------------------------
def _heads(tr):
    """X, W_Q and the per-head Q: what tells the audit there are heads."""
    return {"X": tr.X, "W_q": tr["W_q"], "Q": tr.Q}


@pytest.fixture(scope="module")
def two_heads():
    """A two-head trace (B = 2): per-head H (2, 2, T, 3), W_O (6, D)."""
    rng = np.random.default_rng(5)
    X = rng.normal(size=(2, T, D))
    W = [rng.normal(size=(D, 2 * DK)) for _ in range(3)] + [rng.normal(size=(2 * DK, D))]
    return causalattn.trace(X, *W, n_heads=2)


def test_stage_H_checks_A_V_and_says_how_far_off(two_heads):
    tr = two_heads
    A, V, H = tr.A, tr.V, tr.H
    rep = audit({"A": A, "V": V, "H": H})
    c = _check(rep, "H = A V")
    assert rep.ok and c.ok and c.message.startswith("max |H - A V| = ")
    Hc = H.transpose(0, 2, 1, 3).reshape(2, T, 2 * DK)  # heads concatenated: split back
    assert _check(audit({**_heads(tr), "A": A, "V": V, "H": Hc}), "H = A V").ok
    bad = H.copy()
    bad[1, 0, 3, 2] += 0.5
    rep = audit({"A": A, "V": V, "H": bad})
    c = rep.first_failure
    assert (c.stage, c.name, c.ok) == ("H", "H = A V", False)
    assert c.message == f"max |H - A V| = {0.5:.3g}"
    assert c.evidence == {"index": (1, 0), "rows": [3], "max_err": pytest.approx(0.5)}
    assert c.hint == "H is not A V for these weights and values"
    rep = audit({"A": A, "V": V, "H": H[..., :2]})
    c = rep.first_failure
    assert c.name == "H = A V" and c.message == (
        f"H has shape {H[..., :2].shape} but A V is {H.shape}"
    )
    rep = audit({"A": A, "V": V[:, :, :4]})
    c = rep.first_failure
    assert (c.stage, c.name) == ("H", "H = A V shapes")
    assert (
        c.message == f"A is {A.shape} but V is {V[:, :, :4].shape}; A's key axis must match V's T"
    )
    rep = audit({"A": A, "V": V})  # no H: recomputed, nothing to fail
    assert rep.ok and "H" in rep.recomputed


def test_stage_C_adds_the_contributions_up_to_H(two_heads):
    tr = two_heads
    base = {"A": tr.A, "V": tr.V, "H": tr.H}
    C = tr.C
    assert C.shape == tr.A.shape + (DK,)
    c = _check(audit({**base, "C": C}), "Σ_j C[i, j] = H_i")
    assert c.ok and c.message.startswith("max |Σ_j C[i, j] - H_i| = ")
    bad = C.copy()
    bad[0, 1, 4, 0, 1] += 0.25
    c = audit({**base, "C": bad}).first_failure
    assert (c.stage, c.name) == ("C", "Σ_j C[i, j] = H_i")
    assert c.message == f"max |Σ_j C[i, j] - H_i| = {0.25:.3g}"
    assert c.evidence == {"index": (0, 1), "rows": [4], "max_err": pytest.approx(0.25)}
    assert c.hint == "the contributions do not add up to the output"
    for wrong in (C[..., :2], C[:, :, :4]):
        c = audit({**base, "C": wrong}).first_failure
        assert c.stage == "C" and c.message == (
            f"C is {wrong.shape} but H is {tr.H.shape} (C must be T×T×d_v)"
        )


def test_stage_O_checks_the_output_projection(two_heads):
    tr = two_heads
    W_o, H = tr["W_o"], tr.H
    O = tr.O
    base = {**_heads(tr), "A": tr.A, "V": tr.V, "H": H, "W_o": W_o}
    c = _check(audit({**base, "O": O}), "O = H W_O")
    assert c.ok and c.message.startswith("max |O - H W_O| = ")
    bad = O.copy()
    bad[1, 2, 0] -= 1.0
    c = audit({**base, "O": bad}).first_failure
    assert (c.stage, c.message, c.hint) == ("O", f"max |O - H W_O| = {1.0:.3g}", None)
    assert c.evidence == {"index": (1,), "rows": [2], "max_err": pytest.approx(1.0)}
    c = audit({**base, "O": O, "W_o": W_o[:4]}).first_failure
    assert c.message == "H is T×(h·d_v) = 6×6 but W_O is 4×4"
    c = audit({**base, "O": O[..., :3]}).first_failure
    assert c.message == f"O has shape {O[..., :3].shape} but H W_O is {O.shape}"
    assert c.hint is None and c.evidence == {"shape": O[..., :3].shape}
    Hm = H.transpose(0, 2, 1, 3).reshape(2, T, 2 * DK)  # the merged heads
    W6 = np.random.default_rng(2).normal(size=(6, 6))  # square: transposed or missing show
    rep = audit({**base, "W_o": W6, "O": Hm @ W6.T})
    assert rep.first_failure.hint.endswith("O = H W_Oᵀ: the output projection is transposed")
    rep = audit({**base, "W_o": W6, "O": Hm})
    assert rep.first_failure.hint.endswith("O = H: the output projection is missing")
    c = audit({**base, "W_o": W_o, "O": Hm}).first_failure  # not square: O has H's shape
    assert c.message == f"O has shape {Hm.shape} but H W_O is {O.shape}"
    assert c.hint.endswith("O has H's shape: the output projection is missing")
    assert audit({"A": tr.A, "V": tr.V, "H": H, "O": O}).ok  # no W_O: nothing to check O by


# ---- stage A, check by check --------------------------------------------------------------
def test_stage_A_rows_sum_to_one_with_the_row_sums_as_evidence(parts):
    X, W = parts
    st = _pipeline(X, W)
    A = st["A"].copy()
    A[2] *= 1.5
    A[4] *= 0.5
    rep = audit({"A": A, "V": st["V"]})
    c = rep.first_failure
    assert (c.stage, c.name) == ("A", "rows sum to 1")
    assert c.message == "2 readable rows do not sum to 1 over their readable columns (e.g. 1.5)"
    assert c.evidence == {"rows": [2, 4], "row_sums": [1.5, 0.5]}
    assert c.hint == "rows are not normalized over the key axis"
    ok = _check(audit({"A": st["A"], "V": st["V"]}), "rows sum to 1")
    assert ok.ok and ok.message == "every readable row sums to 1 over its readable columns"
    rep = audit({"A": st["A"] * 0.9, "V": st["V"]}, sinks=[0.3])
    assert _check(rep, "rows sum to 1").ok  # with sinks a row may sum to less than 1
    rep = audit({"A": st["A"] * 1.1, "V": st["V"]}, sinks=[0.3])
    assert not _check(rep, "rows sum to 1").ok  # ... never to more


def test_stage_A_hints_name_how_the_softmax_went_wrong(parts):
    X, W = parts
    st = _pipeline(X, W)
    S = st["S"]
    al = masks.causal(T)
    under = np.where(al, st["A"], 0) * 0.8  # rows below 1, zeros in the right place
    rep = audit({"A": under, "V": st["V"]})
    assert rep.first_failure.hint.endswith(
        "rows sum to less than 1 with zeros in the right place: the mask was likely applied "
        "after the softmax without renormalizing"
    )
    full = ca_softmax(S)
    rep = audit({"S": S, "A": np.where(al, full, 0), "V": st["V"]})
    assert rep.first_failure.hint.endswith(
        "mask applied after softmax without renormalizing: rows sum to less than 1 (the "
        "forbidden weight was dropped, not redistributed)"
    )
    cols = np.where(al, np.exp(S), 0)
    cols = cols / cols.sum(0, keepdims=True)  # softmax down each key column
    assert audit({"A": cols, "V": st["V"]}).first_failure.hint.endswith(
        "columns sum to 1, rows do not: softmax ran over the query axis"
    )
    whole = np.where(al, np.exp(S), 0)
    whole = whole / whole.sum()
    assert audit({"A": whole, "V": st["V"]}).first_failure.hint.endswith(
        "the whole matrix sums to 1: softmax ran over all entries at once"
    )


def ca_softmax(S):
    E = np.exp(S - S.max(-1, keepdims=True))
    return E / E.sum(-1, keepdims=True)


def test_stage_A_blocked_entries_nonfinite_rows_empty_rows_and_the_softmax(parts):
    X, W = parts
    st = _pipeline(X, W)
    A = st["A"].copy()
    A[1, 3] = 0.25  # a future key with weight
    A[1, 0] -= 0.25
    c = _check(audit({"A": A, "V": st["V"]}), "forbidden entries exactly 0")
    assert not c.ok and c.message == "1 blocked entry has nonzero weight (max 0.25)"
    assert c.evidence == {"rows": [1], "cols": [3]}
    assert c.hint.endswith(
        "the mask must be applied before the softmax, with -inf (or a fill whose weight comes "
        "out exactly 0)"
    )
    c = _check(audit({"A": st["A"], "V": st["V"]}), "forbidden entries exactly 0")
    assert c.ok and c.message == "blocked entries have exactly zero weight"
    A = st["A"].copy()
    A[3, 1] = np.inf
    c = _check(audit({"A": A, "V": st["V"]}), "readable rows finite")
    assert not c.ok and c.message == "1 readable row holds NaN or inf"
    assert c.evidence == {"rows": [3]} and c.hint == "NaN/inf weights in rows that can read a key"
    A[2, 0], A[1, 2], A[0, 3] = np.nan, 0.5, 0.25  # one more row of NaN, two blocked entries
    c = _check(audit({"A": A, "V": st["V"]}), "readable rows finite")
    assert c.message == "2 readable rows hold NaN or inf"
    c = _check(audit({"A": A, "V": st["V"]}), "forbidden entries exactly 0")
    assert c.message == "2 blocked entries have nonzero weight (max 0.5)"
    big = {**st, "S": st["S"] * 100, "A": A}
    c = _check(audit(big), "readable rows finite")
    assert c.hint.endswith(
        "scores this large overflow exp(): subtract the row maximum before exponentiating "
        "(stable softmax)"
    )
    assert _check(audit({"A": st["A"], "V": st["V"]}), "readable rows finite").message == (
        "every readable row is finite"
    )
    al = masks.Pattern(lengths=[4]).allowed(1, 1, T, T)[0, 0]
    A = np.where(al, st["A"], 0.0)
    A[:4] /= A[:4].sum(-1, keepdims=True)
    c = _check(audit({"A": A, "V": st["V"], "allowed": al}), "rows with no readable key are zero")
    assert c.ok and c.message == "rows with no readable key have zero weight"
    A[5] = np.nan
    A[4, 0] = 0.1
    c = _check(audit({"A": A, "V": st["V"], "allowed": al}), "rows with no readable key are zero")
    assert not c.ok and c.message == "2 rows with no readable key are not zero (NaN)"
    assert c.evidence == {"rows": [4, 5]} and "0/0" in c.hint
    A[5] = 0.0
    c = _check(audit({"A": A, "V": st["V"], "allowed": al}), "rows with no readable key are zero")
    assert c.message == "1 rows with no readable key are not zero"
    c = _check(audit({"S": st["S"], "A": st["A"], "V": st["V"]}), "A = softmax_last(S + M)")
    assert c.ok and c.message.startswith("max |A - softmax(S + M)| = ")
    hot = ca_softmax(np.where(masks.causal(T), st["S"] * 1.3, -np.inf))  # a distribution, wrong S
    c = _check(audit({"S": st["S"], "A": hot, "V": st["V"]}), "A = softmax_last(S + M)")
    assert not c.ok and c.hint.endswith(
        "A is a distribution per row but not the softmax of these scores: check the scale and "
        "which scores were used"
    )
    assert c.evidence["max_err"] > 0 and "rows" in c.evidence


def test_stage_A_shapes(parts):
    X, W = parts
    st = _pipeline(X, W)
    c = audit({"S": st["S"], "A": st["A"][:, :5], "V": st["V"][:5]}).first_failure
    assert (c.stage, c.name) == ("A", "A has S's shape")
    assert c.message == "A is 6×5 but S (Q Kᵀ) is 6×6 (T_q×T_k)"
    assert c.hint == "A must be T_q×T_k like the scores: was it transposed or sliced?"
    c = audit({"A": st["A"][:, :5], "V": st["V"][:5]}).first_failure
    assert (c.name, c.message) == ("A is T×T", "A is 6×5: more query rows than keys")
    with pytest.raises(AuditInputError, match=r"shape \(5, 6\) does not broadcast to \(6, 6\)"):
        audit({"A": st["A"], "V": st["V"], "allowed": masks.causal(T)[:5]})


def test_stage_A_shapes_with_a_leading_axis_and_a_mask_of_another_shape():
    """The shape checks in full on 3-D arrays (T_q ≠ T_k read from the last two axes), and
    an A whose shape is not the mask's."""
    g = np.random.default_rng(3)
    S = g.standard_normal((2, 3, 5))
    c = audit({"S": S, "A": np.ones((2, 5, 3)) / 3}).first_failure
    assert (c.stage, c.name, c.ok) == ("A", "A has S's shape", False)
    assert c.message == "A is 5×3 but S (Q Kᵀ) is 3×5 (T_q×T_k)"
    assert c.evidence == {"shape": (2, 5, 3)}
    c = audit({"A": np.ones((2, 6, 5)) / 5}).first_failure
    assert (c.stage, c.name, c.ok) == ("A", "A is T×T", False)
    assert c.message == "A is 6×5: more query rows than keys"
    A = np.tile(np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None], (2, 1, 1))
    M = np.where(masks.causal(4), 0.0, -np.inf)
    c = _check(audit({"M": M, "A": A}), "A matches the mask's shape")
    assert (c.stage, c.ok) == ("A", False)
    assert c.message == "A is (2, 4, 4) but the mask/scores are (4, 4)"


# ---- stages H, C and O: what the checks above leave open ---------------------------------
@pytest.mark.parametrize("kept", ["A", "V", "H", "C", "W_o", "O", "A, no H", "V, no H"])
def test_stages_H_C_O_are_as_tolerant_as_their_least_precise_source(parts, kept):
    """One array rounded to float32 (the others float64): H = A V, Σ_j C = H and O = H W_O
    allow float32's error wherever that array is a source, a recomputed H keeping the
    precision of A and V. The same rounding in a float64 array is an error."""
    X, W = parts
    tr = causalattn.trace(X, *W.values())
    name = kept.split(",")[0]
    given = {n: tr[n] for n in ("A", "V", "H", "C", "W_o", "O")}
    if kept.endswith("no H"):
        del given["H"]
    rep = audit({**given, name: given[name].astype(np.float32)})
    assert rep.ok, str(rep)
    assert {c.name for c in rep.checks if c.stage in "HCO"} >= {"Σ_j C[i, j] = H_i", "O = H W_O"}
    assert ("H" in rep.recomputed) == kept.endswith("no H")
    rounded = given[name].astype(np.float32).astype(np.float64)
    assert not audit({**given, name: rounded}).ok  # float64 precision: 1e-7 is an error


def test_stage_H_keeps_a_nan_value_at_a_padding_key_out_and_broadcasts_heads(parts, two_heads):
    """A NaN value at a key no query reads (padding) does not reach H = A V; a V without
    the head axis (one value head for all, multi-query) and an A without the batch axis
    broadcast against each other."""
    tr, al, lengths = _padded_trace(*parts)
    V = tr.V.copy()
    V[1, 4] = np.nan  # a padding key of the second sequence
    rep = audit({"A": tr.A, "V": V, "H": tr.H, "lengths": np.array(lengths)})
    assert rep.ok and _check(rep, "H = A V").ok, str(rep)
    V[1, 2] = np.nan  # a real key: the rows that read it are NaN in A V, not in this H
    c = _check(audit({"A": tr.A, "V": V, "H": tr.H, "lengths": np.array(lengths)}), "H = A V")
    assert not c.ok and c.evidence["index"] == (1,) and c.evidence["rows"] == [2, 3]
    A = two_heads.A  # (2, 2, T, T)
    V0 = two_heads.V[0, 0]  # one (T, d_v) for every sequence and head
    assert audit({"A": A, "V": V0, "H": A @ V0}).ok
    A0 = A[0, 0]  # one (T, T) for every sequence and head of V
    assert audit({"A": A0, "V": two_heads.V, "H": A0 @ two_heads.V}).ok


def test_stage_H_with_more_queries_than_keys_reads_every_key():
    """T_q > T_k: stage M has no mask to give, so H = A V is checked over every key, a
    non-finite value included (it reaches every row that weighs it)."""
    g = np.random.default_rng(7)
    A = g.random((6, 5)) + 0.1
    A /= A.sum(-1, keepdims=True)
    V = g.normal(size=(5, 3))
    rep = audit({"A": A, "V": V, "H": A @ V})
    assert rep.first_failure.name == "A is T×T" and _check(rep, "H = A V").ok, str(rep)
    V[2] = np.inf
    assert _check(audit({"A": A, "V": V, "H": A @ V}), "H = A V").ok  # inf rows, as A V
    H = A @ V
    H[0] = 0.0
    c = _check(audit({"A": A, "V": V, "H": H}), "H = A V")
    assert not c.ok and c.evidence["rows"] == [0]


def test_passing_checks_at_H_C_O_carry_no_evidence_hint_or_fault(two_heads, parts):
    tr = two_heads
    rep = audit({**_heads(tr), **{n: tr[n] for n in ("A", "V", "H", "C", "W_o", "O")}})
    out = [c for c in rep.checks if c.stage in "HCO"]
    assert [(c.stage, c.name) for c in out] == [
        ("H", "H = A V"),  # no row lacks a key: no zero-row check
        ("C", "Σ_j C[i, j] = H_i"),
        ("O", "O = H W_O"),
    ]
    for c in out:
        assert c.ok and (c.evidence, c.hint, c.fault) == ({}, None, None), c
    pad, al, _ = _padded_trace(*parts)
    rep = audit({"A": pad.A, "V": pad.V, "H": pad.H, "allowed": al})
    (c,) = [c for c in rep.checks if c.stage == "H" and c.name.startswith("rows with no")]
    assert c.ok and c.name == "rows with no readable key are zero", str(rep)
    assert (c.message, c.evidence, c.hint) == ("zero output on rows with no readable key", {}, None)
    H = pad.H.copy()
    H[1, 5, 1] = 0.5
    c = audit({"A": pad.A, "V": pad.V, "H": H, "allowed": al}).first_failure
    assert (c.name, c.hint) == (
        "rows with no readable key are zero",
        "a padding query must output zeros, never NaN",
    )
    assert c.evidence == {"index": (1,), "rows": [5]}


def test_failing_checks_at_C_and_O_name_the_check_and_the_fault(parts, two_heads):
    X, W = parts
    tr = causalattn.trace(X, *W.values())  # one head: H is 6×3, W_O 3×4
    base = {"A": tr.A, "V": tr.V, "H": tr.H}
    c = audit({**base, "C": tr.C[..., :2]}).first_failure
    assert (c.stage, c.name, c.ok) == ("C", "Σ_j C[i, j] = H_i", False)
    W5 = np.random.default_rng(8).normal(size=(5, 4))
    two = causalattn.trace(np.stack([X, X]), *W.values())  # and a batch of two: H (2, 6, 3)
    for t in (tr, two):
        given = {"A": t.A, "V": t.V, "H": t.H, "W_o": W5, "O": t.H @ W5[:3]}
        c = audit(given).first_failure
        assert (c.stage, c.name) == ("O", "O = H W_O")
        assert c.message == "H is T×(h·d_v) = 6×3 but W_O is 5×4"
    for O, fault in ((tr.O[:, :2], None), (tr.H, "output-projection-missing")):
        c = audit({**base, "W_o": tr["W_o"], "O": O}).first_failure
        assert (c.stage, c.name, c.fault) == ("O", "O = H W_O", fault), c
    assert c.hint == "output-projection-missing: O has H's shape: the output projection is missing"
    W3 = np.random.default_rng(9).normal(size=(3, 3))  # square: transposed or missing show
    for O, fault in (
        (tr.H @ W3.T, "output-projection-transposed"),
        (tr.H, "output-projection-missing"),
        (tr.H @ W3 + 1.0, None),
    ):
        c = audit({**base, "W_o": W3, "O": O}).first_failure
        assert (c.stage, c.fault) == ("O", fault), c
        assert c.hint is None or c.hint.startswith(f"{fault}: "), c


def test_heads_are_split_for_H_and_merged_for_O_only_when_declared(two_heads):
    """H given with the heads side by side (T, h·d_v) is split for H = A V on one sequence
    too; with W_O and O alone it is checked as it is; without n_heads a leading axis of H
    is a batch O lacks, never heads to merge."""
    g = np.random.default_rng(5)
    X = g.normal(size=(T, D))
    W = [g.normal(size=(D, 2 * DK)) for _ in range(3)] + [g.normal(size=(2 * DK, D))]
    tr = causalattn.trace(X, *W, n_heads=2)  # no batch axis: A is (2, T, T)
    Hc = tr.H.transpose(1, 0, 2).reshape(T, 2 * DK)
    assert _check(audit({**_heads(tr), "A": tr.A, "V": tr.V, "H": Hc}), "H = A V").ok
    rep = audit({"H": Hc, "W_o": tr["W_o"], "O": tr.O, "n_heads": 2})
    assert rep.ok and [c.name for c in rep.checks] == ["O = H W_O"], str(rep)
    one = two_heads.select(1, 1)  # (T, 3) per sequence
    H = np.stack([one.H, one.H])  # (2, T, 3): a batch of two
    W_o = g.normal(size=(DK, D))
    c = audit({"H": H, "W_o": W_o, "O": one.H @ W_o}).first_failure
    assert c.message == f"O has shape {(T, D)} but H W_O is {(2, T, D)}", c


# ---- stage M: a wrong decoding mask, and masks of more query rows than keys ---------------
OVER = "the mask blocks keys that should be readable (j <= i, not padding)"


def _m_trace():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(T, 4))
    return causalattn.trace(X, *(rng.normal(size=(4, 3)) for _ in range(3)))


def test_a_wrong_decoding_mask_is_a_finding_at_M():
    # T_q = 4 < T_k = 6: the transposed causal mask (T_k×T_q) must not be compared with it
    tr = _m_trace()
    Cd = masks.causal(4, T)
    diag = Cd & ~np.eye(4, T, 2, dtype=bool)  # each query's own key blocked
    c = _check(audit({"S": tr.S[2:], "allowed": diag}), "mask is causal (+ padding)")
    assert (c.stage, c.ok, c.hint, c.fault) == ("M", False, OVER, None), c
    # the last key (index 5) is read by no query, so it reads as padding: row 3 is not wrong
    assert c.evidence == {"rows": [0, 1, 2], "cols": [2, 3, 4]}, c
    future = Cd.copy()
    future[0, 3] = True
    c = _check(audit({"S": tr.S[2:], "allowed": future}), "mask is causal (+ padding)")
    assert (c.ok, c.fault) == (False, None) and c.hint.startswith("some queries read future"), c
    assert _check(audit({"S": tr.S[2:], "allowed": Cd}), "mask is causal (+ padding)").ok


def test_a_mask_of_more_queries_than_keys_fails_at_M_with_both_shapes():
    """T_q > T_k: stage M reads no mask, but a given M, Z or mask is a failing check there (A
    of another shape named), must still fit the other arrays, and the verdict is never ok."""
    A = _softmax(np.where(masks.causal(3), 0.0, -np.inf), -1)  # a correct 3×3 causal A
    for name in ("M", "Z"):
        rep = audit({name: np.zeros((4, 2)), "A": A})
        c = _check(rep, "mask is T×T")
        assert not rep.ok and rep.first_failure == c
        assert (c.stage, c.message) == (
            "M",
            f"{name} is 4×2 (more query rows than keys) but A is 3×3",
        )
        assert c.evidence == {"shape": (4, 2)}
        assert c.hint == "more query rows than key columns: is it transposed?"
        assert _check(rep, "forbidden entries exactly 0").ok  # A is still checked on its own
        A42 = np.full((2, 4, 2), 0.5)
        rep = audit({name: np.zeros((2, 4, 2)), "A": A42})  # same shape: A's refusal too
        assert [(c.stage, c.name, c.message) for c in rep.checks if not c.ok] == [
            ("M", "mask is T×T", f"{name} is 4×2: more query rows than keys"),
            ("A", "A is T×T", "A is 4×2: more query rows than keys"),
        ]
        with pytest.raises(AuditInputError, match=rf"^{name}: shape \(3, 3\) does not broadcast"):
            audit({"S": np.zeros((4, 2)), name: np.zeros((3, 3))})
    rep = audit(
        {"allowed": np.ones((4, 2), bool), "M": np.zeros((4, 2)), "A": np.full((4, 2), 0.5)}
    )
    c = _check(rep, "mask is T×T")
    assert c.message == "the declared mask and M are 4×2: more query rows than keys"
    with pytest.raises(
        AuditInputError, match=r"^mask: shape \(4, 2\) does not broadcast to \(3, 3\)$"
    ):
        audit({"allowed": np.ones((4, 2), bool), "A": A})
    with pytest.raises(
        AuditInputError, match=r"^Z: shape \(4, 4\) does not broadcast to \(3, 3\)$"
    ):
        audit({"S": np.zeros((3, 3)), "Z": np.zeros((4, 4))})  # Z named, as M is
    rep = audit({"M": np.zeros((4, 2))})  # M alone: no other stage would say anything
    assert not rep.ok and [c.name for c in rep.checks] == ["mask is T×T"]
    rep = audit({"A": np.full((4, 2), 0.5)})  # no mask given: stage A alone refuses the shape
    assert [c.name for c in rep.checks if not c.ok] == ["A is T×T"]
