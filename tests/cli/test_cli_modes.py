"""`causalattn bench cpu|layer|patterns|io|tune` and `causalattn explore text|trace|model`
and the older spellings they replace, which keep working: `bench` alone (= cpu),
`bench --layer|--patterns|--io|--tune`, `explore "sentence" ...`, `explore --trace F`,
`explore --model DIR "text"`. Each pair gives the same output and exit code; an option that
belongs to another mode is one `error:` line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

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


BENCH_PAIRS = [
    (["bench", "cpu"], ["bench"]),
    (["bench", "cpu", "--quick"], ["bench", "--quick"]),
    (["bench", "layer"], ["bench", "--layer"]),
    (["bench", "layer", "--quick"], ["bench", "--layer", "--quick"]),
    (["bench", "patterns", "--quick"], ["bench", "--patterns", "--quick"]),
    (["bench", "io"], ["bench", "--io"]),
    (["bench", "io", "--quick"], ["bench", "--quick", "--io"]),
    (["bench", "tune"], ["bench", "--tune"]),
    (["bench", "tune", "--out", "t.json"], ["bench", "--tune", "--out", "t.json"]),
]


@pytest.mark.parametrize(("new", "old"), BENCH_PAIRS, ids=lambda a: " ".join(a))
def test_bench_modes_and_their_older_flags_run_the_same(fake_benches, new, old):
    a = invoke(*new, "--json")
    calls_new = list(fake_benches)
    fake_benches.clear()
    b = invoke(*old, "--json")
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    assert a.stdout == b.stdout and calls_new == fake_benches
    mode = new[1]
    ran = {c[0] for c in fake_benches}
    assert ran == ({"io", "startup"} if mode == "io" else {mode})
    quick = "--quick" in new
    data = json.loads(a.stdout)
    if mode in ("cpu", "patterns"):
        assert data == [{"case": mode, "args": [], "quick": quick}]
    elif mode == "layer":
        assert data == [{"case": "layer", "args": [], "budget_s": 8.0 if quick else 20.0}]
    elif mode == "io":
        assert data["startup"] == [{"case": "startup", "args": [], "reps": 3 if quick else 7}]
        assert data["input"] == [
            {"case": "io", "args": [], "reps": 1 if quick else 2, "quick": quick}
        ]
    else:
        assert data == {"out": "t.json" if "--out" in new else "None"}


def test_bench_io_only_one_table(fake_benches):
    data = json.loads(invoke("bench", "io", "--only", "startup", "--json").stdout)
    assert list(data) == ["startup"] and [c[0] for c in fake_benches] == ["startup"]
    data = json.loads(invoke("bench", "io", "--only", "input", "--json").stdout)
    assert list(data) == ["input"]
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
        (["bench", "--layer", "--patterns"], ["--layer and --patterns are two modes"]),
        (["bench", "--io", "--tune"], ["--io and --tune are two modes"]),
    ],
    ids=lambda a: " ".join(a) if a and a[0] == "bench" else "",
)
def test_bench_bad_combinations_are_one_error_line(fake_benches, args, fragments):
    one_error_line(invoke(*args), *fragments)
    assert fake_benches == []  # nothing ran


def test_bench_out_without_tune_is_a_usage_error_as_before(fake_benches):
    res = invoke("bench", "--out", "x.json")
    assert res.exit_code == 2 and res.stderr.startswith("error: ")
    assert "--out goes with --tune" in res.stderr and fake_benches == []


def test_bench_help_lists_the_modes_not_the_hidden_spelling():
    out = invoke("bench", "--help").stdout
    for mode in ("cpu", "layer", "patterns", "io", "tune"):
        assert f" {mode} " in out, mode
    assert "legacy" not in out
    assert "legacy" not in invoke("explore", "--help").stdout


# -- explore ---------------------------------------------------------------------------------


def page(p: Path) -> bytes:
    """A page's bytes, less its nonce and element id (new on every page)."""
    b = re.sub(rb"nonce(-|=\")[A-Za-z0-9_-]+", rb"nonce\1N", p.read_bytes())
    return re.sub(rb"ca-x-[0-9a-f]+", b"ca-x-ID", b)


def pages(tmp_path: Path, new: list, old: list, json_out=True):
    """Run both spellings into two pages; return (new result, old result, new page, old page)."""
    (tmp_path / "new").mkdir(exist_ok=True)
    (tmp_path / "old").mkdir(exist_ok=True)
    pa, pb = tmp_path / "new" / "e.html", tmp_path / "old" / "e.html"  # the page holds its name
    extra = ["--json"] if json_out else []
    a = invoke(*new, "-o", pa, *extra)
    b = invoke(*old, "-o", pb, *extra)
    return a, b, pa, pb


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (["explore", "text"], ["explore"]),
        (
            ["explore", "text", "I love pizza", "you love cheese too"],
            ["explore", "I love pizza", "you love cheese too"],
        ),
        (
            [
                "explore",
                "text",
                "a b c",
                "--d-model",
                "8",
                "--heads",
                "4",
                "--seed",
                "3",
                "--questions",
                "2",
                "--max-len",
                "2",
            ],
            [
                "explore",
                "a b c",
                "--d-model",
                "8",
                "--heads",
                "4",
                "--seed",
                "3",
                "--questions",
                "2",
                "--max-len",
                "2",
            ],
        ),
    ],
    ids=["seed sentences", "two sentences", "every option"],
)
def test_explore_text_and_the_older_spelling_write_the_same_page(tmp_path, new, old):
    a, b, pa, pb = pages(tmp_path, new, old)
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["output"] == str(pa) and jb["output"] == str(pb)
    assert ja["sequences"] == jb["sequences"] > 0
    assert page(pa) == page(pb)
    assert a.stderr == b.stderr  # the --max-len note too


def test_explore_text_file_and_trace_as_before(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one two\n\nthree four five\n", encoding="utf-8")
    a, b, pa, pb = pages(tmp_path, ["explore", "text", "--file", corpus], ["explore", "-f", corpus])
    assert a.exit_code == b.exit_code == 0 and page(pa) == page(pb)
    assert json.loads(a.stdout)["sequences"] == 2
    npz = tmp_path / "t.npz"
    assert invoke("trace", "--save", npz).exit_code == 0
    args = ["--questions", "1", "--seed", "4"]
    a, b, pa, pb = pages(
        tmp_path, ["explore", "trace", npz, *args], ["explore", "--trace", npz, *args]
    )
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    assert page(pa) == page(pb) and json.loads(a.stdout)["sequences"] == 1
    a, b, _, _ = pages(tmp_path, ["explore", "trace", npz], ["explore", "--trace", npz], False)
    assert a.exit_code == b.exit_code == 0
    assert a.stdout.replace("new", "old") == b.stdout
    missing = tmp_path / "missing.npz"
    ea = one_error_line(invoke("explore", "trace", missing), "cannot be read")
    assert ea == one_error_line(invoke("explore", "--trace", missing))


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
def test_explore_text_errors_are_the_older_spelling_s(args):
    new = one_error_line(invoke("explore", "text", *args))
    assert new == one_error_line(invoke("explore", *args))


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
        (["explore", "a b", "--generate", "2"], ["--generate needs --model"]),
        (
            ["explore", "x y", "--trace", "t.npz"],
            ["give sentences, --file or --trace, only one of them"],
        ),
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
