"""`causalattn bench cpu|layer|patterns|io|tune` and `causalattn explore text|trace|model`:
each mode runs its benchmark or page with its options; an option that belongs to another
mode is one `error:` line and exit 2. The spellings from before the modes (`bench --layer`,
`explore "sentence"`, `explore --trace F`) are gone: usage errors; `bench` or `explore`
alone shows its modes and exits 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from causalattn.bench import cpu, io, layer, patterns, startup, tune
from causalattn.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(res, *fragments):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# -- bench -----------------------------------------------------------------------------------


@pytest.fixture
def fake_benches(monkeypatch, tmp_path):
    """Each benchmark replaced by one that records how it was called (the real ones take
    minutes); the rows it returns say so, so the output shows what ran, with which args."""
    calls = []

    def fake(name):
        def run(*args, **kw):
            calls.append((name, args, kw))
            return [{"case": name, "args": list(args), **kw}]

        return run

    monkeypatch.setattr(cpu, "run", fake("cpu"))
    monkeypatch.setattr(layer, "run", fake("layer"))
    monkeypatch.setattr(patterns, "run", fake("patterns"))
    monkeypatch.setattr(io, "run", fake("io"))
    monkeypatch.setattr(startup, "run", fake("startup"))
    monkeypatch.setattr(
        tune,
        "tune",
        lambda out: calls.append(("tune", (out,), {})) or (tmp_path / "t.json", {"out": str(out)}),
    )
    return calls


BENCH_MODES = [
    ["bench", "cpu"],
    ["bench", "cpu", "--quick"],
    ["bench", "layer"],
    ["bench", "layer", "--quick"],
    ["bench", "patterns", "--quick"],
    ["bench", "io"],
    ["bench", "io", "--quick"],
    ["bench", "tune"],
    ["bench", "tune", "--out", "t.json"],
]


@pytest.mark.parametrize("args", BENCH_MODES, ids=" ".join)
def test_bench_modes_run_their_benchmark(fake_benches, args):
    a = invoke(*args, "--json")
    assert a.exit_code == 0, a.output
    mode = args[1]
    ran = {c[0] for c in fake_benches}
    assert ran == ({"io", "startup"} if mode == "io" else {mode})
    quick = "--quick" in args
    data = json.loads(a.stdout)
    assert data["command"] == f"bench {mode}" and data["positions"] == "1-based"
    if mode in ("cpu", "patterns"):
        assert data["rows"] == [{"case": mode, "args": [], "quick": quick}]
    elif mode == "layer":
        assert data["rows"] == [{"case": "layer", "args": [], "budget_s": 8.0 if quick else 20.0}]
    elif mode == "io":
        assert data["startup"] == [{"case": "startup", "args": [], "reps": 3 if quick else 7}]
        assert data["input"] == [
            {"case": "io", "args": [], "reps": 1 if quick else 2, "quick": quick}
        ]
    else:
        assert data["out"] == ("t.json" if "--out" in args else "None")


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--layer"],
        ["bench", "--quick"],
        ["bench", "--tune", "--out", "t.json"],
        ["explore", "a b"],
        ["explore", "--trace", "t.npz"],
        ["explore", "--model", "d", "x"],
    ],
    ids=" ".join,
)
def test_the_spellings_from_before_the_modes_are_usage_errors(fake_benches, args):
    res = invoke(*args)
    assert res.exit_code == 2 and res.stderr.startswith("error: "), res.output
    assert "Traceback" not in res.output and fake_benches == []


@pytest.mark.parametrize("group", ["bench", "explore"])
def test_a_group_alone_shows_its_modes_and_exits_2(fake_benches, group):
    res = invoke(group)
    assert res.exit_code == 2, res.output
    assert ("text" if group == "explore" else "cpu") in res.stdout and fake_benches == []


def test_bench_io_only_one_table(fake_benches):
    data = json.loads(invoke("bench", "io", "--only", "startup", "--json").stdout)
    assert "startup" in data and "input" not in data
    assert [c[0] for c in fake_benches] == ["startup"]
    data = json.loads(invoke("bench", "io", "--only", "input", "--json").stdout)
    assert "input" in data and "startup" not in data
    one_error_line(invoke("bench", "io", "--only", "both"), "--only must be one of startup, input")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["bench", "layer", "--patterns"],
            ["--patterns", "'causalattn bench layer'", "bench patterns"],
        ),
        (["bench", "cpu", "--io"], ["--io does not go with 'causalattn bench cpu'", "bench io"]),
        (["bench", "patterns", "--tune"], ["run 'causalattn bench tune'"]),
        (["bench", "cpu", "--out", "x.json"], ["--out", "goes with 'causalattn bench tune'"]),
        (["bench", "tune", "--quick"], ["--quick does not go with 'causalattn bench tune'"]),
        (["bench", "io", "--layer"], ["run 'causalattn bench layer'"]),
        (["bench", "shape", "1,2,3,4", "--quick"], ["--quick does not go with"]),
    ],
    ids=lambda a: " ".join(a) if a and a[0] == "bench" else "",
)
def test_bench_bad_combinations_are_one_error_line(fake_benches, args, fragments):
    one_error_line(invoke(*args), *fragments)
    assert fake_benches == []  # nothing ran


def test_bench_help_lists_the_modes():
    out = invoke("bench", "--help").stdout
    for mode in ("cpu", "layer", "patterns", "io", "shape", "tune"):
        assert f" {mode} " in out, mode
    assert "legacy" not in out
    assert "legacy" not in invoke("explore", "--help").stdout


# -- explore ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["I love pizza", "you love cheese too"],
        ["a b c", "--d-model", "8", "--heads", "4", "--seed", "3", "--questions", "2"],
    ],
    ids=["seed sentences", "two sentences", "every option"],
)
def test_explore_text_writes_a_page(tmp_path, args):
    out = tmp_path / "e.html"
    res = invoke("explore", "text", *args, "--max-len", "2", "-o", out, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["command"] == "explore text" and data["output"] == str(out)
    assert data["sequences"] == (len(args) if 0 < len(args) < 3 else 1 if args else 4)
    assert out.stat().st_size > 1000


def test_explore_text_file_and_trace(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one two\n\nthree four five\n", encoding="utf-8")
    res = invoke("explore", "text", "--file", corpus, "-o", tmp_path / "a.html", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["sequences"] == 2
    npz = tmp_path / "t.npz"
    assert invoke("trace", "--save", npz).exit_code == 0
    res = invoke("explore", "trace", npz, "--questions", "1", "-o", tmp_path / "b.html", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["sequences"] == 1
    one_error_line(invoke("explore", "trace", tmp_path / "missing.npz"), "cannot be read")


@pytest.mark.parametrize(
    "args",
    [
        ["--heads", "0"],
        ["--d-model", "0"],
        ["--d-model", "10", "--heads", "3"],
        ["--questions", "-1"],
        ["--max-page-bytes", "0"],
        ["--max-len", "100000", "a b"],
        ["-o", "/no/such/folder/e.html"],
    ],
    ids=" ".join,
)
def test_explore_text_errors_are_one_line(args):
    one_error_line(invoke("explore", "text", *args))


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["explore", "text", "--trace", "t.npz"],
            [
                "--trace does not go with 'causalattn explore text'",
                "run 'causalattn explore trace'",
            ],
        ),
        (["explore", "text", "a", "--model", "d"], ["run 'causalattn explore model'"]),
        (
            ["explore", "text", "--generate", "2"],
            ["--generate", "goes with 'causalattn explore model'"],
        ),
        (["explore", "text", "--layers=1"], ["--layers", "'causalattn explore model'"]),
        (
            ["explore", "trace", "t.npz", "--d-model", "8"],
            ["--d-model", "'causalattn explore text'"],
        ),
        (["explore", "trace", "t.npz", "--file", "c.txt"], ["--file", "'causalattn explore text'"]),
        (
            ["explore", "model", "d", "x", "--file", "c.txt"],
            ["--file does not go with 'causalattn explore model'"],
        ),
        (["explore", "model", "d", "x", "--trace", "t.npz"], ["run 'causalattn explore trace'"]),
        (["explore", "text", "a b", "--file", "c.txt"], ["give sentences or --file, not both"]),
    ],
    ids=lambda a: " ".join(a) if a and a[0] == "explore" else "",
)
def test_explore_bad_combinations_are_one_error_line(args, fragments):
    one_error_line(invoke(*args), *fragments)


def test_a_sentence_after_the_mode_separator_is_not_an_option(tmp_path):
    page = tmp_path / "p.html"
    res = invoke("explore", "text", "-o", page, "--json", "--", "--trace")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["sequences"] == 1
