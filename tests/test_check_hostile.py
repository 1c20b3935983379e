"""Untrusted files and code: every hostile case ends in one error line or a status, bounded in
time and memory. Each scenario runs in a subprocess with setrlimit caps and a timeout."""

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

SRC = Path(__file__).parent.parent / "src"
FAULTY = Path(__file__).parent / "faulty"
GiB = 2**30


def _run(code: str, *, timeout=120, mem=6 * GiB):
    """Run Python code in a capped subprocess: (exit code, output, seconds, max RSS in MiB)."""

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**20, 256 * 2**20))

    env = {**os.environ, "PYTHONPATH": str(SRC)}
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
    header = repr({"descr": dtype, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


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
