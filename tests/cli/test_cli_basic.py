"""The `causalattn` command: demo, trace, masks (--window/--chunk: the one M on the command
line, dense and summarized), shapes (text and --json), clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from causalattn import masks, text
from causalattn._trace import Trace
from causalattn.cli import app
from causalattn.text import SEED_SENTENCES

runner = CliRunner()


def run(*args: str, code: int = 0):
    res = runner.invoke(app, list(args))
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    return res


def run_json(*args: str):
    return json.loads(run(*args, "--json").stdout)


def assert_clean_error(res, *fragments: str):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "error:" in res.stderr
    for f in fragments:
        assert f in res.stderr, (f, res.stderr)


# -- demo ------------------------------------------------------------------------------


def test_demo_text():
    out = run("demo").stdout
    for s in (
        "Vocabulary (23 ids",
        "Padded to N = 10",
        "causal mask M, 10×10",
        "together",
        "sentence 4, causal AND padding",
        "audit: ok",
        "[ 0.592 -1.279]",
    ):
        assert s in out, s


def test_demo_json():
    d = run_json("demo")
    assert d["sentences"] == list(SEED_SENTENCES)
    assert len(d["vocab"]) == 23 and d["lengths"] == [10, 8, 8, 6]
    m = np.array(d["combined_sentence_4"])
    np.testing.assert_array_equal(m[:6, :6], np.tril(np.ones((6, 6), bool)))
    assert not m[6:].any() and not m[:, 6:].any()
    assert d["attention"]["audit"]["ok"] is True
    A = np.array(d["attention"]["A_sentence_4"])
    np.testing.assert_allclose(A[:6].sum(axis=1), 1.0)
    assert np.all(A[6:] == 0)
    assert np.round(d["chapter"]["h_4"], 3).tolist() == [0.592, -1.279]


# -- trace -----------------------------------------------------------------------------


def test_trace_default_is_the_chapter_in_dependency_order():
    out = run("trace").stdout
    order = [
        out.index(f"\n{sym}  ") if not out.startswith(sym) else 0
        for sym in ("X", "W_Q", "Q", "S", "M", "Z", "A", "H", "C")
    ]
    assert order == sorted(order)
    assert "S = Q Kᵀ / √d_k   T×T = 4×4" in out
    assert "C[i, j] = A_ij v_j" in out  # rich markup must not eat the brackets
    assert "0.065 0.266 0.131 0.539" in out


def test_trace_query_json_and_save(tmp_path):
    path = tmp_path / "chapter.npz"
    d = run_json("trace", "--query", "4", "--save", str(path))
    names = [s["name"] for s in d["stages"]]
    assert names == ["X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "M", "Z", "A", "H", "C"]
    M = d["stages"][names.index("M")]["value"]
    assert M[0][1] == "-inf" and M[1][0] == 0.0  # strict JSON: -inf as a string
    ex = d["explain"]
    assert ex["query"] == 4
    assert [round(k["weight"], 3) for k in ex["keys"]] == [0.065, 0.266, 0.131, 0.539]
    assert np.round(ex["h"], 3).tolist() == [0.592, -1.279]
    tr = Trace.load(path)
    assert np.round(tr.H[3], 3).tolist() == [0.592, -1.279]
    out = run("trace", "-q", "4").stdout
    assert "The four quantities for query 4" in out and "1.078" in out


def test_trace_from_json_and_npz(tmp_path):
    rng = np.random.default_rng(0)
    X, Wq, Wk, Wv, Wo = (rng.normal(size=s) for s in ((5, 3), (3, 2), (3, 2), (3, 4), (4, 3)))
    mask = np.tril(np.ones((5, 5), bool))
    mask[4, :] = False
    js = tmp_path / "in.json"
    js.write_text(
        json.dumps(
            {
                "X": X.tolist(),
                "W_q": Wq.tolist(),
                "W_k": Wk.tolist(),
                "W_v": Wv.tolist(),
                "W_o": Wo.tolist(),
                "mask": mask.tolist(),
            }
        )
    )
    npz = tmp_path / "in.npz"
    np.savez(npz, X=X, W_q=Wq, W_k=Wk, W_v=Wv, W_o=Wo, mask=mask)
    for f in (js, npz):
        d = run_json("trace", "--input", str(f))
        st = {s["name"]: np.array(s["value"], dtype=object) for s in d["stages"]}
        assert st["O"].shape == (5, 3)
        assert np.all(st["A"][4] == 0) and np.all(st["H"][4] == 0)


def test_trace_errors_are_clean(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"X": [[1, 0], [0, 1]], "W_q": [[1, 0, 0]], "W_k": [[1]], "W_v": [[1]]})
    )
    assert_clean_error(runner.invoke(app, ["trace", "-i", str(bad)]), "projections", "2×2")
    miss = tmp_path / "miss.json"
    miss.write_text(json.dumps({"X": [[1]]}))
    assert_clean_error(runner.invoke(app, ["trace", "-i", str(miss)]), "missing W_q, W_k, W_v")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    assert_clean_error(runner.invoke(app, ["trace", "-i", str(junk)]), "cannot be read")
    assert_clean_error(runner.invoke(app, ["trace", "-q", "5"]), "--query must be a position 1..4")
    pickled = tmp_path / "obj.npz"
    np.savez(pickled, X=np.array([{"a": 1}], dtype=object), W_q=[[1]], W_k=[[1]], W_v=[[1]])
    assert_clean_error(runner.invoke(app, ["trace", "-i", str(pickled)]), "cannot be read")


# -- masks -----------------------------------------------------------------------------


def test_masks_sentences_both_forms():
    out = run("masks", "Cheese and burgers", "I love pizza with cheese").stdout
    assert "causal 5×5" in out and "-∞" in out and "✓" in out and "·" in out
    assert "sentence 1 (3 tokens): Cheese and burgers <PAD> <PAD>" in out
    only = run("masks", "a b", "--form", "check").stdout
    assert "✓" in only and "-∞" not in only


def test_masks_file_json(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SEED_SENTENCES) + "\n\n")
    d = run_json("masks", "--file", str(corpus))
    assert d["N"] == 10 and len(d["sentences"]) == 4
    s4 = d["sentences"][3]
    assert s4["length"] == 6 and s4["key_padding"] == [True] * 6 + [False] * 4
    m = np.array(s4["combined"])
    np.testing.assert_array_equal(m[:6, :6], np.tril(np.ones((6, 6), bool)))
    assert not m[6:].any()
    # default corpus: the seed's sentences
    assert run_json("masks")["vocab"] == d["vocab"]


def test_masks_truncation_is_reported():
    res = run("masks", "a b c d", "--max-len", "2", "--json")
    assert "truncated to max_len=2" in res.stderr
    assert json.loads(res.stdout)["truncated"] == [1]  # sentence 1: positions are 1-based


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["masks", "a b", "   "], "text: sentence 2"),
        (["masks", "--form", "dots"], "--form must be one of"),
        (["masks", "a", "--file", "x.txt"], "not both"),
        (["masks", "--file", "/nonexistent/c.txt"], "cannot read corpus file"),
        (["shapes", "--d-model", "1000", "--heads", "3"], "not divisible by --heads 3"),
        (["shapes", "--max-len", "0"], "--max-len must be a positive integer"),
    ],
)
def test_errors_exit_2_without_traceback(args, fragment):
    assert_clean_error(runner.invoke(app, args), fragment)


# -- shapes ----------------------------------------------------------------------------


def test_shapes_seed_table():
    out = run("shapes", "--max-len", "2048", "--d-model", "1000", "--heads", "1").stdout
    for s in ("2048×1000", "1000×2048", "2048×2048", "1000×1000", "16.0 MiB"):
        assert s in out
    d = run_json("shapes")
    rows = {r["symbol"]: r for r in d["rows"]}
    assert rows["Kᵀ"]["shape"] == [1000, 2048] and rows["W_O"]["params"] == 1_000_000
    assert d["totals"]["attention_flops_dense"] == 4 * 2048**2 * 1000
    assert d["totals"]["attention_flops_causal"] == 2 * 2048**2 * 1000
    d = run_json("shapes", "-T", "128", "--d-model", "512", "-H", "8")
    assert {r["symbol"]: r for r in d["rows"]}["Q"]["shape"] == [8, 128, 64]


# --- masks --window/--chunk -------------------------------------------------------


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


# -- the group ---------------------------------------------------------------------------
def test_version_prints_the_packages_version_and_exits_0():
    import causalattn

    res = run("--version")
    assert res.stdout == f"causalattn {causalattn.__version__}\n"
    # called from Python (click's standalone_mode=False), the exit code is returned: 0
    group = typer.main.get_command(app)
    assert group.main(["--version"], standalone_mode=False) == 0


def test_no_arguments_print_the_help_with_the_one_line_summary():
    res = runner.invoke(app, [], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert "Usage:" in res.output and "--version" in res.output, res.output
    assert "Causal self-attention in matrix form" in res.output


def test_a_command_added_to_the_group_is_listed_after_the_documented_ones_and_runs():
    """click's add_command on the built group: a new name is listed last; one under a
    documented name replaces that command."""
    import click
    import click.testing

    from causalattn.cli import COMMANDS

    group = typer.main.get_command(app)
    group.add_command(click.Command("extra", callback=lambda: click.echo("extra ran")))
    group.add_command(click.Command("demo", callback=lambda: click.echo("my demo")))
    ctx = click.Context(group)
    assert group.list_commands(ctx) == [*COMMANDS, "extra"]
    for name, said in (("extra", "extra ran"), ("demo", "my demo")):
        res = click.testing.CliRunner().invoke(group, [name])
        assert res.exit_code == 0 and res.stdout == said + "\n", (name, res.output)
    assert group.list_commands(ctx) == [*COMMANDS, "extra"]  # once each, also when loaded
