"""Huge and hostile input, untrusted files and code: bounded memory, bounded time, one-line
errors, and nothing computed silently wrong.

Everything that could blow up runs in a subprocess capped with ``resource.setrlimit``
(address space, CPU seconds, file size) and a wall-clock timeout, so a regression fails the
test instead of taking the machine down. The last test fuzzes the CLI's arguments and
attention, trace and encode inputs (tests/check/fuzz_inputs.py) in one such subprocess.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from _helpers import npy_header
from typer.testing import CliRunner

import causalattn as ca
from causalattn import masks
from causalattn.cli import app

runner = CliRunner()
SRC = str(Path(__file__).resolve().parents[2] / "src")
FAULTY = Path(__file__).parents[1] / "faulty"
GiB = 2**30


def capped(
    args: list[str],
    *,
    mem: int = 3 * GiB,
    cpu: int = 60,
    timeout: float = 120,
    cwd=None,
    stdin=None,
) -> subprocess.CompletedProcess:
    """Run ``python args`` with address space and CPU time capped; wall clock bounded."""

    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

    env = {
        **os.environ,
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "COLUMNS": "100",
    }
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limits,
        env=env,
        cwd=cwd,
        input=stdin,
    )


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return capped(["-m", "causalattn.cli", *args], **kw)


_BATCH = """
import json, sys
from typer.testing import CliRunner
from causalattn.cli import app
out = []
for argv in json.loads(sys.stdin.read()):
    r = CliRunner().invoke(app, argv)
    out.append({"returncode": r.exit_code, "stdout": r.stdout, "stderr": r.stderr})
print(json.dumps(out))
"""


class Result:
    def __init__(self, d: dict):
        self.returncode, self.stdout, self.stderr = d["returncode"], d["stdout"], d["stderr"]


def cli_many(argvs: list[list[str]], **kw) -> list[Result]:
    """Several CLI runs in ONE capped subprocess (importing torch once, not per case)."""
    res = capped(["-c", _BATCH], stdin=json.dumps(argvs), **kw)
    assert res.returncode == 0, res.stderr[-2000:]
    return [Result(d) for d in json.loads(res.stdout)]


def one_error_line(res, *fragments: str) -> None:
    """Exit 2, stderr leads with one ``error:`` line, no traceback anywhere."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    err = res.stderr
    assert err.startswith("error: "), err
    assert "Traceback" not in out, out
    for f in fragments:
        assert f in err.splitlines()[0], (f, err)


@pytest.fixture(scope="module")
def huge_sentence(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = rng.integers(0, 5000, size=100_000)
    p = tmp_path_factory.mktemp("huge") / "huge.txt"
    p.write_text(" ".join(f"w{w}" for w in words) + "\n")
    return p


# -- Batch keeps lengths; dense masks only on demand ------------------------------------


def test_batch_masks_are_lazy_and_match_the_dense_definition():
    b = ca.encode(["a b c d e", "f g"], max_len=6)
    dense = masks.combine(
        masks.causal(6)[None],
        masks.key_padding(b.lengths, 6)[:, None, :],
        masks.query_padding(b.lengths, 6)[:, :, None],
    )
    np.testing.assert_array_equal(b.mask, dense)
    np.testing.assert_array_equal(b.sentence_mask(1), dense[1])
    np.testing.assert_array_equal(b.mask_block(1, 5, 2, 6), dense[:, 1:5, 2:6])
    c = b.mask_counts()
    assert c["readable"].tolist() == [int(m.sum()) for m in dense]
    assert (c["readable"] + c["future"] + c["padding"]).tolist() == [36, 36]
    seed = ca.encode(ca.text.SEED_SENTENCES)
    cs = seed.mask_counts()
    L = seed.lengths
    for k in range(seed.B):
        m = seed.sentence_mask(k)
        assert cs["readable"][k] == m.sum()
        real = np.outer(np.arange(10) < L[k], np.arange(10) < L[k])
        assert cs["padding"][k] == (~real).sum()
        assert cs["future"][k] == (real & ~m).sum()


def test_huge_batch_refuses_dense_masks_but_summarizes():
    b = ca.encode([" ".join(["w"] * 50_000)])
    with pytest.raises(ValueError, match=r"mask.*50000.*would take .* GiB.*max_bytes"):
        _ = b.mask
    with pytest.raises(ValueError, match="max_bytes"):
        b.sentence_mask(0)
    assert b.mask_counts()["readable"].tolist() == [50_000 * 50_001 // 2]
    assert b.mask_block(49_998, 50_000, 0, 2).tolist() == [[[True, True], [True, True]]]
    with pytest.raises(ValueError, match=r"ids \(B, N\) = \(1, 1000000000000\).*max_len"):
        ca.encode(["a b"], max_len=10**12)


def test_encode_of_a_100000_word_sentence_is_linear(huge_sentence):
    code = (
        f"import causalattn as ca; b = ca.encode([open({str(huge_sentence)!r}).read()]); "
        "print(b.N, b.mask_counts()['readable'][0])"
    )
    res = capped(["-c", code], mem=2 * GiB, cpu=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["100000", str(100_000 * 100_001 // 2)]


# -- the CLI on huge input ----------------------------------------------------------------


def test_huge_sentence_masks_summarized_and_refused_where_dense(huge_sentence, tmp_path):
    f = str(huge_sentence)
    js, txt, exp = cli_many(
        [
            ["masks", "--file", f, "--json"],
            ["masks", "--file", f, "--form", "check"],
            ["explore", "text", "--file", f, "-o", str(tmp_path / "e.html")],
        ],
        mem=3 * GiB,
        cpu=120,
        timeout=300,
    )
    assert js.returncode == 0, js.stderr
    d = json.loads(js.stdout)
    s = d["sentences"][0]["combined"]
    assert d["N"] == 100_000 and s["summarized"] and s["shape"] == [100_000, 100_000]
    assert s["rows"] == [1, 2, 3, 4, 99_997, 99_998, 99_999, 100_000] == s["cols"]
    np.testing.assert_array_equal(np.array(s["cells"]), np.tril(np.ones((8, 8), bool)))
    assert s["readable"] == 100_000 * 100_001 // 2 and s["padding"] == 0
    assert len(js.stdout) < 5e6
    assert txt.returncode == 0, txt.stderr
    assert "100000" in txt.stdout and "…" in txt.stdout and "⋮" in txt.stdout
    assert "5,000,050,000 readable" in txt.stdout and "--full" in txt.stdout
    one_error_line(exp, "would take")
    assert not (tmp_path / "e.html").exists()


OVERSIZED = [
    (["masks", "a b", "--max-len", "100000", "--full"], ["--full", "max-bytes"]),
    (["masks", "a b", "--max-len", "1000000000000"], ["would take", "max_len"]),
    (["explore", "text", "--max-len", "100000", "a b"], ["would take", "--max-len"]),
    (["demo", "--d-model", "1000000000"], ["d_model = 1000000000", "--max-bytes"]),
    (["explore", "text", "--heads", "0"], ["--heads must be a positive integer"]),
    (["explore", "text", "--d-model", "0"], ["--d-model must be a positive integer"]),
    (["explore", "text", "--d-model", "10", "--heads", "3"], ["divisible"]),
    (["demo", "--d-model", "-3"], ["--d-model"]),
]


def test_oversized_or_invalid_sizes_are_one_error_line(tmp_path):
    results = cli_many([a for a, _ in OVERSIZED], mem=2 * GiB, cwd=tmp_path)
    for (_, fragments), res in zip(OVERSIZED, results):
        one_error_line(res, *fragments)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_explore_page_is_capped_with_a_note(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"sentence number {k} is here" for k in range(3000)))
    (res,) = cli_many(
        [
            [
                "explore",
                "text",
                "--file",
                str(corpus),
                "-o",
                str(tmp_path / "e.html"),
                "--json",
                "--max-page-bytes",
                str(2**20),
            ]
        ]
    )
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert 1 <= d["sequences"] < 3000 and d["bytes"] < 1.3 * 2**20
    assert f"sentences 1..{d['sequences']} of 3000" in res.stderr
    assert "\x1b" not in res.stderr + res.stdout  # no progress bar off a terminal


# -- one error line for every failure -----------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["masks", "--bogus"], "No such option: --bogus"),
        (["trace", "-q"], "requires an argument"),
        (["trace", "-q", "x"], "Invalid value for '--query'"),
        (["nosuchcommand"], "No such command"),
        (["diagnose"], "Missing argument"),
    ],
)
def test_usage_errors_lead_with_one_error_line(args, fragment):
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    first, *rest = res.stderr.splitlines()
    assert first.startswith("error: ") and fragment in first, res.stderr
    assert all("error" not in r for r in rest) and "╭" not in res.stderr


def _write(tmp_path, name, content) -> str:
    p = tmp_path / name
    p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    return str(p)


GOOD = {
    "X": [[1, 0], [0, 1]],
    "W_q": [[1, 0], [0, 1]],
    "W_k": [[1, 0], [0, 1]],
    "W_v": [[1, 1], [1, -1]],
}


TRACE_INPUTS = [
    ("empty.npz", b"", "the file is empty"),
    ("x.npz", b"PK\x03\x04garbage", "cannot be read as .npz or JSON"),
    ("x.json", "{not json", "not valid JSON"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("deep2.json", '{"X": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ("tok.json", json.dumps({**GOOD, "tokens": 5}), "tokens must be a list of T = 2"),
    ("tok2.json", json.dumps({**GOOD, "tokens": ["a"]}), "tokens must be a list of T = 2"),
    ("tok3.json", json.dumps({**GOOD, "tokens": [["a"], ["b"]]}), "tokens must be a list"),
    ("ragged.json", json.dumps({**GOOD, "X": [[1, 0], [1]]}), "X is not a rectangular array"),
    ("str.json", json.dumps({**GOOD, "X": [["a", "b"], ["c", "d"]]}), "X must hold numbers"),
    ("dict.json", json.dumps({**GOOD, "W_q": {"a": 1}}), "W_q must hold numbers"),
]


def test_trace_input_problems_are_one_error_line(tmp_path):
    X = np.zeros((20_000, 2))  # T×T stages of 3 GiB: refused before they are built
    np.savez(tmp_path / "big.npz", X=X, W_q=np.eye(2), W_k=np.eye(2), W_v=np.eye(2))
    np.savez(tmp_path / "none.npz")
    nan = {**GOOD, "X": [[float("nan"), 0], [0, 1]]}
    big = {**GOOD, "X": [[1e308, 1e308], [1e308, 1e308]]}
    argvs = [["trace", "-i", _write(tmp_path, n, c)] for n, c, _ in TRACE_INPUTS]
    argvs += [
        ["trace", "-i", str(tmp_path / "big.npz")],
        ["trace", "-i", str(tmp_path / "none.npz")],
        ["trace", "-i", str(tmp_path)],
        ["trace", "-i", _write(tmp_path, "x.txt", json.dumps(GOOD)), "--json"],
        ["trace", "-i", _write(tmp_path, "n.json", json.dumps(nan)), "--json"],
        ["trace", "-i", _write(tmp_path, "b.json", json.dumps(big)), "--json"],
    ]
    res = cli_many(argvs, mem=2 * GiB)
    for (_, _, fragment), r in zip(TRACE_INPUTS, res):
        one_error_line(r, fragment)
    big_r, none_r, folder_r, txt_r, nan_r, over_r = res[len(TRACE_INPUTS) :]
    one_error_line(big_r, "--max-bytes")
    one_error_line(none_r, "holds no arrays")
    one_error_line(folder_r, "is a folder")
    assert txt_r.returncode == 0, txt_r.stderr  # read by content: a .txt holding JSON works
    assert nan_r.returncode == 0 and "warning: X holds 1 non-finite" in nan_r.stderr
    assert over_r.returncode == 0 and "warning: H holds NaN or inf" in over_r.stderr


def test_output_folders_are_never_created(tmp_path):
    missing = tmp_path / "nope" / "deeper"
    one_error_line(
        runner_result("explore", "text", "-o", str(missing / "e.html")), "does not exist"
    )
    one_error_line(runner_result("trace", "--save", str(missing / "t.npz")), "does not exist")
    one_error_line(runner_result("masks", "--png", str(missing)), "does not exist")
    assert not (tmp_path / "nope").exists()
    with pytest.raises(ValueError, match="does not exist"):
        ca.viz.write_explorer(
            ca.trace(np.eye(2), np.eye(2), np.eye(2), np.eye(2)), missing / "e.html"
        )


class _Res:
    def __init__(self, r):
        self.returncode, self.stdout, self.stderr = r.exit_code, r.stdout, r.stderr


def runner_result(*args) -> _Res:
    return _Res(runner.invoke(app, list(args)))


# -- one position convention on the command line: 1-based --------------------------------


def test_trace_json_query_and_keys_are_both_1_based():
    res = runner.invoke(app, ["trace", "-q", "4", "--json"])
    d = json.loads(res.stdout)
    assert d["positions"] == "1-based"
    ex = d["explain"]
    assert ex["query"] == 4 and [r["key"] for r in ex["keys"]] == [1, 2, 3, 4]
    out = runner.invoke(app, ["trace", "-q", "2"]).stdout
    assert "query i=2:" in out and "  3  (blocked" in out and "  4  (blocked" in out


def test_explain_in_python_stays_0_based_and_checks_its_argument():
    tr = ca.trace(np.eye(3), np.eye(3), np.eye(3), np.eye(3))
    assert tr.explain(2).query == 2 and str(tr.explain(0)).startswith("query i=0")
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match="explain: query i must be an integer"):
            tr.explain(bad)


# -- the Python API: clear ValueErrors or correct results ---------------------------------


def _qkv(B=2, H=2, T=8, d=4):
    import torch

    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, d, generator=g) for _ in range(3))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"scale": float("nan")}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"causal": None}, "causal"),
        ({"lengths": "8,3"}, "lengths"),
        ({"lengths": [8.0, 3.0]}, "lengths"),
    ],
)
def test_attention_refuses_hostile_arguments(kw, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        ca.attention(q, k, v, **kw)


def test_attention_and_layer_shapes_at_zero():
    import torch

    z = torch.zeros(1, 1, 3, 0)
    with pytest.raises(ValueError, match="d_k >= 1 and d_v >= 1"):
        ca.attention(z, z, z)
    q, k, _ = _qkv(1, 1, 3, 2)
    with pytest.raises(ValueError, match="d_k >= 1 and d_v >= 1"):
        ca.attention(q, k, torch.zeros(1, 1, 3, 0))
    for bias in (False, True):
        layer = ca.CausalSelfAttention(8, 2, proj_bias=bias)
        assert layer(torch.zeros(0, 3, 8)).shape == (0, 3, 8)  # B = 0: an empty batch
        with pytest.raises(ValueError, match="d_model=8"):
            layer(torch.zeros(2, 3, 0))
        with pytest.raises(ValueError, match="lengths"):
            layer(torch.zeros(2, 3, 8), lengths="8,3")
    for scale in (float("nan"), float("inf"), "x", True):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            ca.CausalSelfAttention(8, 2, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        ca.trace(np.eye(3), np.eye(3), np.eye(3), np.eye(3), scale=float("nan"))


def test_kv_cache_refuses_what_it_cannot_hold_or_would_cast():
    import torch

    k = torch.zeros(1, 2, 2, 4)
    for cap in (0, 2.5, "8", True):
        with pytest.raises(ValueError, match="capacity must be a positive integer"):
            ca.KVCache(capacity=cap)
    with pytest.raises(ValueError, match=r"1000000000000 positions.*GiB.*capacity"):
        ca.KVCache(capacity=10**12).append(k, k)
    with pytest.raises(ValueError, match="k must be a torch.Tensor.*from_numpy"):
        ca.KVCache().append(np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="k is torch.float32 .* but v is torch.float64"):
        ca.KVCache().append(k, k.double())
    c = ca.KVCache(capacity=2)
    c.append(k, k)
    with pytest.raises(ValueError, match="cache is torch.float32"):
        c.append(k.double(), k.double())
    K, V = c.append(k + 1, k + 2)  # grows past capacity by doubling
    assert K.shape == (1, 2, 4, 4) and V[:, :, 2:].eq(2).all() and len(c) == 4


def test_audit_evidence_is_1_based_on_the_command_line(tmp_path):
    tr = ca.trace(np.eye(4)[:, :2] + 0.5, np.eye(2), np.eye(2), np.eye(2))
    arrays = {n: tr[n] for n in ("X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "A", "H")}
    arrays["A"] = arrays["A"].copy()
    arrays["A"][2, 3] = 0.25  # a future key read by query 2 (0-based): row 3 on the CLI
    np.savez(tmp_path / "bad.npz", **arrays)
    py = ca.audit(tmp_path / "bad.npz").first_failure
    res = runner.invoke(app, ["audit", str(tmp_path / "bad.npz"), "--json"])
    assert res.exit_code == 1, res.output
    d = json.loads(res.stdout)
    cli_ev = d["first_failure"]["evidence"]
    assert d["positions"] == "1-based" and py.evidence["rows"]
    assert cli_ev["rows"] == [r + 1 for r in py.evidence["rows"]]
    if "cols" in py.evidence:
        assert cli_ev["cols"] == [c + 1 for c in py.evidence["cols"]]
    assert 2 in py.evidence["rows"] and 3 in cli_ev["rows"]
    text = runner.invoke(app, ["audit", str(tmp_path / "bad.npz")]).stdout
    assert f"rows={cli_ev['rows']}" in text


def test_a_row_reading_nan_keeps_exact_zeros_where_it_may_not_read():
    # found by the fuzz test: a NaN row used to spread NaN into its blocked entries
    X = np.array([[1.0], [np.nan]])
    mask = np.array([[True, True], [False, True]])  # row 1 reads the NaN key; (2, 1) blocked
    tr = ca.trace(X, np.eye(1), np.eye(1), np.eye(1), mask=mask, causal=False)
    assert np.isnan(tr.A[0]).all() and tr.A[1, 0] == 0.0


def test_explore_of_long_sentences_stays_within_max_bytes(tmp_path):
    corpus = tmp_path / "long.txt"
    corpus.write_text("\n".join(" ".join(f"w{k % 97}" for k in range(1500)) for _ in range(4)))
    (res,) = cli_many(
        [
            [
                "explore",
                "text",
                "--file",
                str(corpus),
                "-o",
                str(tmp_path / "e.html"),
                "--json",
                "--max-bytes",
                str(2**29),
            ]
        ],
        mem=3 * GiB,
        cpu=120,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    # one 1,500-token sentence's float64 stages take ~300 MB: only one fits 512 MiB
    assert d["sequences"] == 1 and "of memory can trace at N = 1500" in res.stderr


# --- untrusted files and code: one error line or a status, each in a capped process ---


def _run(code: str, *, timeout=120, mem=6 * GiB):
    """Run Python code in a capped subprocess: (exit code, output, seconds, max RSS in MiB)."""

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**20, 256 * 2**20))

    env = {**os.environ, "PYTHONPATH": SRC}
    t0 = time.monotonic()
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=caps,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        pytest.fail(f"did not finish within {timeout} s")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return p.returncode, out.decode("utf-8", "replace"), time.monotonic() - t0, rss


def _cli(*args, **kw):
    code = (
        "import sys; from causalattn.cli import main; "
        f"sys.argv = ['causalattn', *{list(args)!r}]; main()"
    )
    return _run(code, **kw)


def _one_error(rc, out):
    assert rc == 2, out
    lines = [s for s in out.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    assert "Traceback" not in out


def _npy_bytes(shape, dtype="<f8", data=b"") -> bytes:
    return npy_header(shape, dtype) + data


# -- files ----------------------------------------------------------------------------------
def test_npz_member_without_npy_suffix(tmp_path):
    p = tmp_path / "x.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("q.npy", _npy_bytes((4, 2), data=np.zeros((4, 2)).tobytes()))
        zf.writestr("A", _npy_bytes((4, 4), data=np.zeros((4, 4)).tobytes()))
    rc, out, _, _ = _cli("audit", str(p))
    _one_error(rc, out)
    assert "not a .npy array" in out


def test_npz_declaring_a_huge_A_next_to_a_small_q_is_refused_before_reading(tmp_path):
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("q.npy", _npy_bytes((8, 2), data=np.zeros((8, 2)).tobytes()))
        zf.writestr("A.npy", _npy_bytes((16000, 16000), data=bytes(2 * 2**20)))
    rc, out, secs, rss = _cli("audit", str(p))
    _one_error(rc, out)
    assert "16000×16000" in out and "refused before reading" in out
    assert rss < 1500, rss  # nothing was inflated (torch's import is most of this)


def test_npz_over_the_budget_is_refused_by_its_headers(tmp_path):
    p = tmp_path / "big.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:  # 1.9 GiB of zeros declared
        zf.writestr("A.npy", _npy_bytes((int(1.9 * GiB) // 8,), data=bytes(4 * 2**20)))
    rc, out, _, rss = _cli("audit", str(p), "--max-bytes", str(GiB))
    _one_error(rc, out)
    assert "limit" in out and rss < 1500


def test_fifo_is_refused_not_waited_on(tmp_path):
    p = tmp_path / "x.npz"
    os.mkfifo(p)
    rc, out, secs, _ = _cli("audit", str(p), timeout=60)
    _one_error(rc, out)
    assert "not a regular file" in out


@pytest.mark.parametrize(
    "header",
    [
        b"[1, 2, 3]",
        b'{"A": 5}',
        b'{"A": {"dtype": "F64", "shape": [2, 2], "data_offsets": ["0", "32"]}}',
        b"[" * 100000 + b"]" * 100000,
        b'{"A": {"dtype": "F64", "shape": [2, 2], "data_offsets": [0, 9999]}}',
        b'{"A": {"dtype": "OBJ", "shape": [2], "data_offsets": [0, 16]}}',
    ],
    ids=["list", "not-object", "string-offsets", "deep", "out-of-range", "dtype"],
)
def test_malformed_safetensors(tmp_path, header):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))
    rc, out, _, _ = _cli("audit", str(p))
    _one_error(rc, out)


@pytest.mark.parametrize(
    "extra",
    [
        {"scale": np.array(0.0)},
        {"lengths": np.array([4.0])},
        {"scale": np.array(np.nan)},
        {"n_heads": np.array(0)},
    ],
    ids=["scale0", "float-lengths", "scale-nan", "heads0"],
)
def test_bad_metadata(tmp_path, extra):
    rng = np.random.default_rng(0)
    p = tmp_path / "x.npz"
    np.savez(
        p,
        q=rng.normal(size=(4, 2)),
        k=rng.normal(size=(4, 2)),
        v=rng.normal(size=(4, 2)),
        A=np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None],
        **extra,
    )
    rc, out, _, _ = _cli("audit", str(p))
    _one_error(rc, out)
    assert next(iter(extra)) in out


def test_symlink_to_text_does_not_echo_its_bytes(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN-1234 do not print me\n")
    link = tmp_path / "dump.npz"
    link.symlink_to(secret)
    rc, out, _, _ = _cli("audit", str(link))
    _one_error(rc, out)
    assert "SECRET" not in out and "1234" not in out


def test_bf16_safetensors_is_read(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from causalattn import trace
    from causalattn.check.inputs import load_arrays

    rng = np.random.default_rng(1)
    X = rng.normal(size=(5, 4))
    tr = trace(X, *(rng.normal(size=(4, 4)) for _ in range(3)))
    tensors = {
        n: torch.from_numpy(np.ascontiguousarray(tr[n])).to(torch.bfloat16)
        for n in ("Q", "K", "V", "A")
    }
    p = tmp_path / "x.safetensors"
    st.save_file(tensors, str(p))
    got = load_arrays(p)
    assert got["A"].dtype == np.float32
    assert np.array_equal(got["A"], tensors["A"].float().numpy())
    rc, out, _, _ = _cli("audit", str(p))
    assert rc in (0, 1) and "error" not in out.split("\n")[0], out


# -- code -----------------------------------------------------------------------------------
def _diagnose(call: str, **kw):
    code = f"""
        import json, sys, time
        sys.path.insert(0, {str(FAULTY.parent)!r})
        from causalattn import diagnose
        t0 = time.monotonic()
        d = {call}
        print(json.dumps({{"status": str(d.status), "message": d.message,
                           "secs": time.monotonic() - t0}}))
    """
    rc, out, _, _ = _run(code, **kw)
    assert rc == 0, out
    return json.loads(out.strip().splitlines()[-1])


HOSTILE = textwrap.dedent("""
    import os, subprocess, sys, time

    def hangs(q, k, v):
        while True:
            pass

    def spawns(q, k, v):
        p = subprocess.Popen(["sleep", "300"])
        with open(os.environ["PID_FILE"], "w") as fh:
            fh.write(str(p.pid))
        while True:
            time.sleep(0.1)

    def exits(q, k, v):
        sys.exit(3)

    def hard_exit(q, k, v):
        os._exit(4)

    def allocates(q, k, v):
        keep = []
        while True:
            keep.append(bytearray(50 * 2**20))

    def prints(q, k, v):
        while True:
            print("x" * 2**20)
""")


@pytest.fixture
def hostile(tmp_path):
    p = tmp_path / "hostile.py"
    p.write_text(HOSTILE)
    return p


def test_callable_timeout_is_real(hostile):
    d = _diagnose(f"diagnose(__import__('runpy').run_path({str(hostile)!r})['hangs'], timeout=3)")
    assert d["status"] == "timeout" and d["secs"] < 30, d


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state


@pytest.mark.parametrize("form", ["file", "callable"])
def test_grandchildren_are_killed(hostile, tmp_path, form):
    pid_file = tmp_path / "pid"
    os.environ["PID_FILE"] = str(pid_file)
    try:
        target = (
            repr(f"{hostile}:spawns")
            if form == "file"
            else f"__import__('runpy').run_path({str(hostile)!r})['spawns']"
        )
        d = _diagnose(f"diagnose({target}, timeout=25)")
    finally:
        del os.environ["PID_FILE"]
    assert d["status"] == "timeout", d
    pid = int(pid_file.read_text())
    for _ in range(50):
        if _gone(pid):
            break
        time.sleep(0.1)
    assert _gone(pid), f"grandchild {pid} survived"


@pytest.mark.parametrize(
    "name, status, words",
    [
        ("exits", "crashed", "sys.exit(3)"),
        ("hard_exit", "crashed", "exit code 4"),
        ("allocates", "crashed", "memory"),
        ("prints", None, ""),
    ],
)
def test_exit_memory_and_output(hostile, name, status, words):
    d = _diagnose(
        f"diagnose({str(hostile) + ':' + name!r}, timeout=60, max_memory=2**28)", timeout=180
    )
    if status:
        assert d["status"] == status and words in d["message"], d
    else:  # a flood of output is capped: the worker stops, the caller does not
        assert d["status"] in ("error", "crashed", "timeout") and d["secs"] < 120, d


# --- fuzzing: hypothesis over the CLI's arguments and attention, trace, encode inputs ---


@pytest.mark.slow
def test_fuzz_clean_error_or_correct_result(tmp_path):
    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (4 * GiB, 4 * GiB))
        resource.setrlimit(resource.RLIMIT_CPU, (600, 600))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
    }
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve().parent / "fuzz_inputs.py"),
            str(tmp_path),
            "80",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=limits,
        env=env,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-8000:]
    for name in ("fuzz_cli", "fuzz_attention", "fuzz_trace", "fuzz_encode"):
        assert f"ok {name}" in res.stdout, res.stdout
