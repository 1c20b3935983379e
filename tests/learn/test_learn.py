"""causalattn learn: questions computed by the library, scaffolds, and grading with diagnose.

Reference solutions live in tests/learn_solutions (never in the package); each catalogued
diagnose fault is planted into one of them by a textual change, as a learner would make it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import causalattn as ca
from causalattn import text
from causalattn.cli import app
from causalattn.learn import KINDS, exercises, grade, questions
from causalattn.learn.exercises import EXERCISES, FRAMEWORKS

SOL = Path(__file__).parents[1] / "learn_solutions"


def _catalogue():
    """The diagnose catalogue: fault id -> stage."""
    from causalattn.check import CATALOGUE

    return {f.id: f.stage for f in CATALOGUE}


# fault -> (solution file, text in it, the learner's mistake)
PLANTS = {
    "k-not-transposed": ("scores_numpy", "q @ k.T", "q @ k"),
    "missing-scale": ("scores_torch", " / math.sqrt(d_k)", ""),
    "scale-by-dk": ("scores_numpy", "/ np.sqrt(d_k)", "/ d_k"),
    "diagonal-blocked": ("mask_numpy", "(j <= i)", "(j < i)"),
    "no-mask": ("mask_numpy", "(j <= i) & ", ""),
    "anti-causal-mask": ("mask_torch", "(j <= i)", "(j >= i)"),
    "padding-ignored": ("mask_torch", " & (j < length) & (i < length)", ""),
    "padding-queries-only": ("mask_numpy", " & (j < length)", ""),
    "finite-min-added-twice": (
        "mask_numpy",
        "    readable = (j <= i) & (j < length) & (i < length)\n"
        "    return np.where(readable, 0.0, -np.inf)",
        "    low = np.finfo(np.float64).min\n"
        "    causal = np.where(j <= i, 0.0, low)\n"
        "    keys = np.where(j < length, 0.0, low)\n"
        "    queries = np.where(i < length, 0.0, low)\n"
        "    return causal + keys + queries",
    ),
    "softmax-query-axis": ("softmax_torch", "dim=-1", "dim=-2"),
    "softmax-all-entries": ("softmax_numpy", "axis=-1", "axis=None"),
    "mask-after-softmax": (
        "attention_torch",
        'Z = S.masked_fill(future, float("-inf"))\n    A = torch.softmax(Z, dim=-1)',
        "A = torch.softmax(S, dim=-1).masked_fill(future, 0.0)",
    ),
    "unstable-softmax": ("softmax_numpy", "e = np.exp(z - m)", "e = np.exp(z)"),
    "nan-on-empty-rows": (
        "softmax_torch",
        "torch.where(total > 0, e / total.clamp_min(1e-300), torch.zeros_like(e))",
        "e / total",
    ),
    "scale-by-sqrt-dv": (
        "attention_numpy",
        "S = q @ k.T / np.sqrt(d_k)",
        "S = q @ k.T / np.sqrt(v.shape[1])",
    ),
    "scale-by-sqrt-dmodel": ("multihead_numpy", "/ np.sqrt(d_k) + M", "/ np.sqrt(x.shape[1]) + M"),
    "some-heads-only": (
        "multihead_numpy",
        "/ np.sqrt(d_k) + M",
        "/ np.sqrt(d_k) + (M if n else 0)",
    ),
    "output-projection-missing": ("multihead_numpy", "return H @ w_o", "return H"),
    "output-projection-transposed": ("multihead_torch", "@ w_o", "@ w_o.T"),
}
# Catalogued faults no exercise can hold: decoding (T_q < T_k), declared windows, fp16, and a
# fill only scores beyond the probes' reach (≈ 10⁴) overcome.
NOT_IN_EXERCISES = {
    "causal-top-left",
    "window-off-by-one",
    "finite-fill-too-weak",
    "softmax-fp16-accumulation",
}
# With the seed's right padding a padding key is always in a real query's future, so blocking
# only the padding query rows gives the very same M: nothing to find in this exercise.
SAME_M = {"padding-queries-only"}


def _plant(tmp_path, fault) -> Path:
    name, old, new = PLANTS[fault]
    src = (SOL / f"{name}.py").read_text()
    assert old in src, (fault, old)
    p = tmp_path / f"{name}_{fault}.py"
    p.write_text(src.replace(old, new))
    return p


def _strings(obj):
    """Every string inside a JSON-like object, each line stripped."""
    if isinstance(obj, str):
        yield from (s.strip() for s in obj.splitlines())
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _fixes(fault: str, planted: Path) -> list[str]:
    """The solution's lines that the planted file lacks: what a grade must never show."""
    mine = {s.strip() for s in planted.read_text().splitlines()}
    return [
        s.strip()
        for s in (SOL / f"{PLANTS[fault][0]}.py").read_text().splitlines()
        if s.strip() and s.strip() not in mine
    ]


# -- exercises --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(SOL.glob("*.py")), ids=lambda p: p.stem)
def test_reference_solution_passes(path):
    g = grade.grade_file(path)
    assert g.status == "right" and g.exit_code == 0, str(g)
    assert [s["status"] for s in g.stages] == ["right"] * len(g.stages)
    assert [s["stage"] for s in g.stages] == ["shape", *EXERCISES[g.exercise].stages]
    assert g.framework == path.stem.split("_")[1]


def test_every_catalogued_fault_is_planted():
    assert set(PLANTS) | NOT_IN_EXERCISES == set(_catalogue())


@pytest.mark.parametrize("fault", sorted(set(PLANTS) - SAME_M))
def test_planted_fault_is_named_at_its_stage(tmp_path, fault):
    planted = _plant(tmp_path, fault)
    g = grade.grade_file(planted)
    assert g.status == "wrong" and g.exit_code == 1, str(g)
    stage = {"some-heads-only": "M"}.get(fault, _catalogue()[fault])  # the planted head's stage
    assert g.fault == fault and g.stage == stage, str(g)
    assert g.hint == grade.HINTS[fault]
    states = {st["stage"]: st["status"] for st in g.stages}
    assert states[g.stage] == "wrong"
    order = [st["stage"] for st in g.stages]
    assert all(states[st] == "right" for st in order[: order.index(g.stage)])
    assert all(states[st] == "not graded" for st in order[order.index(g.stage) + 1 :])
    found = (g.diagnosis or {}).get("location")  # diagnose's file:line, kept when it is theirs
    if found and Path(found.rsplit(":", 1)[0]).resolve() == planted.resolve():
        assert g.location == found
    shown = {s.strip() for s in str(g).splitlines()} | set(_strings(g.to_dict()))
    fixes = _fixes(fault, planted)
    assert fixes and not shown & set(fixes), "a grade never shows the fix"


def test_padding_queries_only_gives_the_same_mask_with_right_padding(tmp_path):
    ns = {}
    exec(_plant(tmp_path, "padding-queries-only").read_text(), ns)
    ref = {}
    exec((SOL / "mask_numpy.py").read_text(), ref)
    for T in range(1, 8):
        for L in range(T + 1):
            assert np.array_equal(ns["mask"](T, L), ref["mask"](T, L))
    assert grade.grade_file(_plant(tmp_path, "padding-queries-only")).ok


def test_location_points_into_the_learner_file(tmp_path):
    planted = _plant(tmp_path, "output-projection-transposed")
    g = grade.grade_file(planted)
    file, line = g.location.rsplit(":", 1)
    assert Path(file).resolve() == planted.resolve()
    assert "@ w_o.T" in planted.read_text().splitlines()[int(line) - 1]


def test_grade_function_in_this_process():
    import math

    import torch

    def attention(q, k, v):  # a notebook cell's attempt: the mask forgotten
        return torch.softmax(q @ k.T / math.sqrt(q.shape[1]), dim=-1) @ v

    g = grade.grade_function(attention)
    assert g.framework == "torch" and g.fault == "no-mask" and g.exit_code == 1
    assert "✗ M" in " ".join(repr(g).split())
    ref = {}
    exec((SOL / "softmax_numpy.py").read_text(), ref)
    assert grade.grade_function(ref["softmax"]).ok
    with pytest.raises(ValueError, match="which exercise"):
        grade.grade_function(lambda q, k, v: v)


def test_mask_stage_shows_the_learner_pattern(tmp_path):
    g = grade.grade_file(_plant(tmp_path, "diagonal-blocked"))
    assert g.pattern is not None and g.pattern["measured"] != g.pattern["expected"]
    assert g.pattern["measured"][0][0] == "-∞" and g.pattern["expected"][0][0] == "0"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", list(EXERCISES))
def test_scaffold_as_written_could_not_run(tmp_path, name, framework):
    p = exercises.write(name, tmp_path / f"{name}.py", framework)
    src = p.read_text()
    assert src.startswith(f"{exercises.MARK} {name} ({framework})")
    assert f"def {EXERCISES[name].function}(" in src and "×" in src
    g = grade.grade_file(p)
    assert g.status == "error" and g.exit_code == 2 and "not written yet" in g.message
    with pytest.raises(ValueError, match="exists already"):
        exercises.write(name, p, framework)


def test_scaffold_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown exercise"):
        exercises.scaffold("flash")
    with pytest.raises(ValueError, match="framework"):
        exercises.scaffold("mask", "jax")


def test_finite_fill_in_the_mask_is_shown_and_hinted(tmp_path):
    p = tmp_path / "m.py"
    p.write_text((SOL / "mask_numpy.py").read_text().replace("-np.inf", "-1e4"))
    g = grade.grade_file(p)
    assert g.status == "wrong" and g.stage == "M" and g.hint == grade._FINITE_FILL, str(g)
    assert g.pattern["measured"][0][1] == "?" and g.pattern["expected"][0][1] == "-∞"


def test_wrong_shape_is_a_wrong_stage(tmp_path):
    p = tmp_path / "a.py"
    p.write_text((SOL / "attention_numpy.py").read_text().replace("return A @ v", "return A"))
    g = grade.grade_file(p)
    assert g.status == "wrong" and g.stage == "shape" and "expected 5×2" in g.message, str(g)


def test_unknown_fault_names_a_stage(tmp_path):
    p = tmp_path / "s.py"
    p.write_text((SOL / "scores_numpy.py").read_text().replace("q @ k.T", "-(q @ k.T)"))
    g = grade.grade_file(p)
    assert g.status == "wrong" and g.stage == "S" and g.fault is None and g.hint, str(g)


def test_check_in_a_subprocess_broken_and_hanging_files(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text(f"{exercises.MARK} attention (numpy)\ndef attention(q, k, v):\n    return (\n")
    g = grade.check(bad)
    assert g.status == "error" and g.exit_code == 2 and "SyntaxError" in g.message
    boom = tmp_path / "boom.py"
    boom.write_text("raise SystemExit(3)\n")
    g = grade.grade_file(boom)  # what the subprocess runs: the file's own exit is caught
    assert g.exit_code == 2 and "SystemExit" in g.message
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import time\n\ndef attention(q, k, v):\n    while True:\n        time.sleep(0.1)\n"
    )
    g = grade.check(hang, timeout=3)
    assert g.exit_code == 2 and "did not finish" in g.message
    assert grade.check(tmp_path / "nope.py").exit_code == 2  # refused before any subprocess


def test_cli_check_exit_code_and_json(tmp_path):
    r = CliRunner().invoke(app, ["learn", "--check", str(_plant(tmp_path, "no-mask")), "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.output)
    assert d["status"] == "wrong" and d["fault"] == "no-mask" and d["exit_code"] == 1
    assert d["hint"] == grade.HINTS["no-mask"] and d["pattern"]["measured"]


def test_rendered_grade_shows_stages_pattern_and_hint(tmp_path):
    from rich.console import Console

    from causalattn.learn import session

    for fault, wants in (
        ("anti-causal-mask", ("a stage is wrong", "✗ M", "yours", "expected", "hint:")),
        ("mask-after-softmax", ("✓ M", "✗ A", "· H", "not graded", "hint:")),
    ):
        console = Console(record=True, width=100)
        session.render_grade(grade.grade_file(_plant(tmp_path, fault)), console)
        out = " ".join(console.export_text().split())
        assert all(w in out for w in wants), out


def test_cli_writes_scaffolds(tmp_path):
    runner = CliRunner()
    out = tmp_path / "mine.py"
    r = runner.invoke(
        app, ["learn", "--exercise", "softmax", "-o", str(out), "--framework", "torch"]
    )
    assert r.exit_code == 0 and out.read_text() == exercises.scaffold("softmax", "torch", str(out))
    assert f"causalattn learn --check {out}" in out.read_text()
    r = runner.invoke(app, ["learn", "--exercise", "softmax", "-o", str(out)])
    assert r.exit_code == 2 and "error:" in r.output
    r = runner.invoke(app, ["learn", "--exercise", "nope", "-o", str(tmp_path / "x.py")])
    assert r.exit_code == 2 and "unknown exercise" in r.output
    r = runner.invoke(app, ["learn", "--framework", "torch"])  # no scaffold to apply it to
    assert r.exit_code == 2 and "go with --exercise" in r.output


# -- questions --------------------------------------------------------------------------------
def _plain_softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _recomputed(q):
    """The answer, recomputed here without the generator's code paths."""
    d, kind = q["data"], q["kind"]
    if kind == "softmax-axis":
        tr = ca.trace(d["X"], d["W_q"], d["W_k"], d["W_v"])
        assert np.allclose(tr.A.sum(-1), 1)  # rows are the distributions
        return "across the 5 columns within each query row (the last, key axis)"
    if kind in ("mask-cell", "mask-count", "padding-rows"):
        b = d["sentence"]
        L, N = len(text.tokenize(text.SEED_SENTENCES[b])), 10
        if kind == "mask-count":
            return str(L * (L + 1) // 2)
        if kind == "padding-rows":
            return f"rows {L + 1}–{N}"
        i, j = d["i"], d["j"]
        future, padded = j > i, i >= L or j >= L
        assert text.encode(list(text.SEED_SENTENCES)).mask[b][i, j] == (not future and not padded)
        name = {
            (False, False): "readable",
            (True, False): "future",
            (False, True): "padding",
            (True, True): "both",
        }[(bool(future), bool(padded))]
        from causalattn.learn.questions import _CELL

        return _CELL[name]
    if kind == "window-row":  # HF sliding_window: the last w positions, the query's included
        i, w = d["i"], d["window"]
        return f"keys {i - w + 2}–{i + 1}"
    if kind == "window-count":
        T, w = d["T"], d["window"]
        return str((T - w) * (T - w + 1) // 2)
    if kind == "shape":
        rows = {r.symbol: r for r in ca.shape_table(d["seq_len"], d["d_model"], d["n_heads"])}
        return rows[d["symbol"]].notation
    X, Wq, Wk, Wv = (np.array(d[k], float) for k in ("X", "W_q", "W_k", "W_v"))
    Q, K, V = X @ Wq, X @ Wk, X @ Wv
    S = Q @ K.T / np.sqrt(Q.shape[1])
    i = d["i"]
    A_i = _plain_softmax(S[i, : i + 1])  # row i over keys 0..i
    if kind == "weight":
        return f"{A_i[d['j']]:.3f}"
    if kind == "contribution":
        return "[" + ", ".join(f"{x:.3f}" for x in A_i[d["j"]] * V[d["j"]]) + "]"
    if kind == "top-contributor":
        k = int(np.argmax(np.linalg.norm(A_i[:, None] * V[: i + 1], axis=1)))
        return f"key {k + 1} ('{d['tokens'][k]}')"
    if kind == "mask-after-softmax":
        return f"{_plain_softmax(S[i])[: i + 1].sum():.3f}"
    raise AssertionError(kind)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_question_answers_match_a_recomputation(seed):
    qs = questions(seed=seed)
    assert [q["kind"] for q in qs] == list(KINDS)
    assert json.loads(json.dumps(qs)) == qs
    for q in qs:
        assert 0 <= q["answer"] < len(q["choices"]) and len(set(q["choices"])) == len(q["choices"])
        assert q["prompt"] and q["hint"] and q["explanation"]
        assert q["choices"][q["answer"]] == _recomputed(q), q


def test_questions_are_seeded_and_validated():
    assert questions(seed=3, n=12) == questions(seed=3, n=12)
    assert questions(seed=3) != questions(seed=4)
    assert len(questions(seed=1, n=20)) == 20
    qs = questions(seed=0)
    assert qs[0]["highlight"] == {"matrix": "A", "axis": "row", "row": 2}
    for q in qs:  # what a page needs to draw the picture: the sentence, or a trace (+ its mask)
        if "sentence" in (q["highlight"] or {}):
            assert q["sentence"] == q["highlight"]["sentence"] == q["data"]["sentence"]
        elif q["kind"] != "shape":
            assert {"X", "W_q", "W_k", "W_v", "tokens"} <= set(q["data"])
        if q["kind"].startswith("window"):
            T, w = q["data"]["T"], q["data"]["window"]
            band = np.tri(T, dtype=bool) & ~np.tri(T, k=-w, dtype=bool)  # the last w keys
            assert np.array_equal(np.array(q["data"]["mask"]), band)
    for bad in ({"seed": -1}, {"n": 0}, {"seed": 1.5}, {"kinds": ["nope"]}):
        with pytest.raises(ValueError, match="learn"):
            questions(**bad)


def test_cli_json_bank_and_piped_answers():
    runner = CliRunner()
    r = runner.invoke(app, ["learn", "--json", "--seed", "5"])
    assert r.exit_code == 0
    bank = json.loads(r.output)
    assert bank == questions(seed=5)
    right = "".join(f"{q['answer'] + 1}\n" for q in bank)
    r = runner.invoke(app, ["learn", "--seed", "5"], input="h\n" + right)
    assert r.exit_code == 0, r.output
    assert f"score: {len(bank)}/{len(bank)} right" in r.output and "hint:" in r.output
    wrong = "".join(f"{(q['answer'] + 1) % len(q['choices']) + 1}\n" for q in bank[:3])
    r = runner.invoke(app, ["learn", "--seed", "5"], input=wrong)
    assert f"score: 0/{len(bank)} right (3 wrong, {len(bank) - 3} skipped" in r.output
    r = runner.invoke(
        app, ["learn", "--json", "--kind", "shape", "--kind", "window-row", "-n", "3"]
    )
    assert [q["kind"] for q in json.loads(r.output)] == ["shape", "window-row", "shape"]
    r = runner.invoke(app, ["learn", "--kind", "nope"])
    assert r.exit_code == 2 and "unknown question kinds" in r.output
    r = runner.invoke(app, ["learn"], input="")  # nothing on stdin: no hang, a score
    assert r.exit_code == 0 and f"score: 0/{len(bank)}" in r.output
