"""The command line behaves the same in every command, run as a user runs it (a real
`python -m causalattn` process, memory and time capped):

- `--version`; the bare command shows its help and exits 2, as do `bench` and `explore`;
- every failure is one `error:` line on stderr and exit 2, and under `--json` one JSON
  document on stdout (`command`, `positions`, `error`, `exit_code`) with the exit code kept;
  `diagnose`'s failures too; no Python name (`compare_masks:`) leads a message;
- every `--json` output shares the top-level shape `{"command", "positions": "1-based"}`;
- the sequence length is `--max-len` everywhere (`shapes --seq-len` and `heads --length`
  still work, unlisted); positions and layers count from 1 (a 0 is refused, saying so);
- `bench shape B,H,T,d` times the engines given, bad shapes are one `error:` line.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest
from tests._helpers import SRC

import causalattn

GiB = 2**30


def cli(*args, timeout: float = 120):
    """`python -m causalattn ARGS` in a fresh process (3 GiB address space, ``timeout``)."""

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (3 * GiB, 3 * GiB))

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.update(COLUMNS="100", TERM="dumb", CAUSALATTN_ENGINE="")
    return subprocess.run(
        [sys.executable, "-m", "causalattn", *map(str, args)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=caps,
        env=env,
        timeout=timeout,
    )


def one_error(res, *fragments) -> str:
    """The one `error:` line of a failure (exit 2, nothing on stdout, no traceback)."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "" and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("error: "), res.stderr
    assert len(lines) == 1 or lines[1].startswith("Try "), res.stderr  # usage errors: a hint
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def json_error(res, command: str, *fragments) -> dict:
    """The JSON document of a failure under --json: on stdout, exit code kept."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "error:" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    assert doc["command"] == command and doc["positions"] == "1-based", doc
    assert doc["exit_code"] == 2 and isinstance(doc["error"], str), doc
    for f in fragments:
        assert f in doc["error"], (f, doc)
    return doc


def test_version_and_the_bare_commands():
    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"causalattn {causalattn.__version__}"
    for args in ([], ["bench"], ["explore"]):
        res = cli(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr)  # as the README says
        assert "Usage:" in res.stdout and res.stderr == "", (args, res.stderr)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("consistency")
    np.savez(d / "mask.npz", mask=np.tril(np.ones((4, 4), bool)))
    (d / "raises.py").write_text("def attention(q, k, v):\n    raise RuntimeError('boom')\n")
    return d


# (command as JSON names it, its arguments, a fragment of the one error line)
FAILURES = [
    ("shapes", ["shapes", "--nope"], "No such option: --nope"),
    ("shapes", ["shapes", "--max-len", "0"], "--max-len must be a positive integer"),
    ("masks", ["masks", "--form", "dots"], "--form must be one of"),
    ("trace", ["trace", "--query", "0"], "positions count from 1"),
    ("trace", ["trace", "--query", "5"], "--query must be a position 1..4"),
    ("audit", ["audit", "x", "--model", "nowhere", "--layers", "0"], "layers count from 1"),
    ("audit", ["audit", "x", "--model", "nowhere", "--layers", "0-2"], "layers count from 1"),
    # compare_masks refuses slopes for 2 heads on a 1-head mask: not "compare_masks: ..."
    ("audit", ["audit", "{d}/mask.npz", "--alibi-slopes", "1,2"], "expected shape (H,)"),
    ("diagnose", ["diagnose", "{d}/none.py:attention"], "none.py: no such file"),
    ("diagnose", ["diagnose", "{d}/raises.py:attention"], "RuntimeError: boom"),
    ("diagnose", ["diagnose", "{d}/raises.py:nothing"], "has no 'nothing'"),
    ("bench shape", ["bench", "shape", "1,2,3"], "expected B,H,T,d"),
    ("bench shape", ["bench", "shape", "1,2,0,4"], "four positive integers"),
    ("bench shape", ["bench", "shape", "x,2,3,4"], "expected B,H,T,d"),
    ("bench shape", ["bench", "shape", "4096,64,4096,128"], "--max-bytes"),
    ("bench shape", ["bench", "shape", "1,1,8,8", "--engine", "nope"], "unknown engine 'nope'"),
]
FAILURE_IDS = [" ".join(a) for _, a, _ in FAILURES]


@pytest.mark.parametrize(("command", "args", "fragment"), FAILURES, ids=FAILURE_IDS)
def test_a_failure_is_one_error_line_and_under_json_one_document(files, command, args, fragment):
    args = [a.format(d=files) for a in args]
    line = one_error(cli(*args), fragment)
    # no Python name leads the message (compare_masks:, trace.heads:), nor the command's
    assert not re.match(r"error: (\w+\.)*\w*[_.]\w*(\(\))?: ", line), line
    assert not line.startswith(f"error: {command.split()[0]}:"), line
    doc = json_error(cli(*args, "--json"), command, fragment)
    assert doc["error"] == line.removeprefix("error: ")


def test_diagnose_that_could_not_run_keeps_its_diagnosis_under_json(files):
    doc = json_error(cli("diagnose", f"{files}/raises.py:attention", "--json"), "diagnose")
    assert doc["diagnosis"]["status"] == "error" and "boom" in doc["diagnosis"]["message"]


def test_every_json_output_shares_the_top_level_shape(tmp_path):
    runs = {
        "shapes": ["shapes", "-T", "8", "--d-model", "8"],
        "masks": ["masks", "a b c"],
        "trace": ["trace", "--query", "4"],
        "learn": ["learn"],
        "bench shape": ["bench", "shape", "1,1,8,8", "--engine", "tiled", "--reps", "2"],
    }
    for command, args in runs.items():
        res = cli(*args, "--json")
        assert res.returncode == 0, (args, res.stderr)
        doc = json.loads(res.stdout)
        assert (doc["command"], doc["positions"]) == (command, "1-based"), (command, list(doc))
    assert json.loads(cli("trace", "--query", "4", "--json").stdout)["explain"]["query"] == 4


def test_the_sequence_length_is_max_len_and_the_old_names_are_unlisted_aliases():
    want = cli("shapes", "--max-len", "16", "--d-model", "8", "--json")
    assert want.returncode == 0, want.stderr
    assert json.loads(want.stdout)["seq_len"] == 16
    for alias in (["--seq-len", "16"], ["--seq-len=16"], ["-T", "16"]):
        res = cli("shapes", *alias, "--d-model", "8", "--json")
        assert res.stdout == want.stdout, alias
    for command in (["shapes"], ["masks"], ["heads"], ["explore", "text"]):
        out = cli(*command, "--help").stdout
        assert "--max-len" in out, command
        assert "--seq-len" not in out and "--length " not in out, command
    # heads' old name reaches the command (its error is the missing model, not the option)
    one_error(cli("heads", "--model", "/no/such/model", "--length", "8"), "/no/such/model")
    one_error(cli("masks", "--seq-len", "3"), "No such option: --seq-len")  # shapes' only


def test_bench_shape_times_the_engines_given_against_the_peer():
    res = cli("bench", "shape", "1,2,16,8", "--engine", "tiled", "--engine", "reference",
              "--reps", "3", "--json", timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    rows = doc["rows"]
    assert [r["engine"] for r in rows] == ["tiled", "reference"]  # the peer is timed, not shown
    for r in rows:
        assert r["shape"] == [1, 2, 16, 8] and r["peer"] == "sdpa" and r["reps"] == 3
        assert r["ms"] > 0 and r["vs_peer"] > 0
    res = cli("bench", "shape", "1,2,16,8", "--engine", "sdpa", "--engine", "auto", "--reps",
              "3", timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "sdpa's time / this" in res.stdout and "auto (ran " in res.stdout
