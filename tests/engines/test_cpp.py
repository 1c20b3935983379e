"""The native CPU engine (engine="cpp"): every Pattern combination with modifiers, sinks and
dropout against the tiled engine (the accuracy rule; the dropout pattern bit for bit), the
same bits on 1 and 2 threads, its decoding path and its lanes, and the engine unavailable
(no compiler, a failing build): the fallback is taken and named. The shared guarantees
(zero rows, NaN causality, gradcheck, lse) are tests/engines/test_engine_contract.py's row."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_every_pattern import cases

from causalattn.engines import attention, contract, cpp, exact, make_problem, tiled

pytestmark = pytest.mark.skipif(bool(cpp.unavailable()), reason=cpp.unavailable() or "built")


def _cast(t, dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@settings(max_examples=40, deadline=None)
@given(cases(max_T=40), st.sampled_from([0.0, 0.25]))
def test_every_pattern_with_modifiers_and_dropout_meets_the_accuracy_rule(case, p):
    """fp32 cpp and tiled against the fp64 reference, forward and gradients, within twice
    plain fp32 math's error (docs/design.md's rule), on the same dropout pattern."""
    (q64, k64, v64), kw = case
    kw = {n: _cast(x, torch.float32) for n, x in kw.items()}
    leaves64 = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    ref = attention(*leaves64, engine="reference", dropout_p=p, generator=gen(), **kw)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rg = torch.autograd.grad(ref, leaves64, dout) if ref.numel() else [torch.zeros(1)] * 3
    # plain fp32 math on the same dropout pattern: the rule's yardstick
    leaves = [t.float().requires_grad_() for t in (q64, k64, v64)]
    prob = make_problem(*leaves, dropout_p=p, generator=gen(), **kw)
    plain = contract.plain(prob, torch.float32, exact.dropout_mask(prob))
    pg = torch.autograd.grad(plain, leaves, dout.float()) if plain.numel() else rg
    for name in ("cpp", "tiled"):
        xs = [t.float().requires_grad_() for t in (q64, k64, v64)]
        out = attention(*xs, engine=name, dropout_p=p, generator=gen(), **kw)
        assert _err(out, ref) <= 2 * _err(plain, ref) + 1e-5, name
        if out.numel():
            gs = torch.autograd.grad(out, xs, dout.float())
            for n, a, b, c in zip("qkv", gs, pg, rg):
                assert _err(a, c) <= 2 * _err(b, c) + 1e-5, f"{name} d{n}"


@settings(max_examples=30, deadline=None)
@given(cases(max_T=40), st.sampled_from([0.1, 0.5, 1.0]))
def test_the_dropout_pattern_is_the_hash_bit_for_bit(case, p):
    """With V = I the output is the dropped weights: cpp's zeros are exactly the cells the
    counter-based hash drops (or the pattern blocks), as the tiled engine's and the
    reference's."""
    (q, k, _), kw = case
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    eye = torch.eye(T_k, dtype=torch.float64).expand(B, k.shape[1], T_k, T_k).contiguous()
    kw = {n: x for n, x in kw.items() if n != "sinks"}
    outs = {
        name: attention(
            q, k, eye, engine=name, dropout_p=p, generator=torch.Generator().manual_seed(3), **kw
        )
        for name in ("cpp", "tiled", "reference")
    }
    zero = {name: o == 0 for name, o in outs.items()}
    assert torch.equal(zero["cpp"], zero["tiled"]) and torch.equal(zero["cpp"], zero["reference"])
    prob = make_problem(q, k, eye, dropout_p=p, generator=torch.Generator().manual_seed(3), **kw)
    keep = exact.dropout_mask(prob) & prob.allowed().expand(B, H, T_q, T_k)
    # a kept readable weight is > 0 (exp of a finite score) unless it underflows
    assert not (zero["cpp"] & keep & (outs["reference"] != 0)).any()


def _run_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize(
    "shape,kw",
    [
        ((2, 4, 2, 300, 300, 32), {}),  # several query blocks, GQA
        ((1, 1, 1, 700, 700, 16), {"window": 100}),  # lanes > 1 in the backward
        ((1, 2, 2, 3, 2000, 24), {"alibi_slopes": [0.5, 0.1]}),  # decoding: key splits
        ((1, 2, 2, 256, 256, 16), {"dropout_p": 0.2, "softcap": 5.0, "sinks": [0.1, -2.0]}),
    ],
)
def test_the_same_bits_on_one_and_two_threads(shape, kw):
    B, Hq, Hkv, Tq, Tk, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, Tq, d, generator=g)
    k, v = torch.randn(B, Hkv, Tk, d, generator=g), torch.randn(B, Hkv, Tk, d, generator=g)
    dout = torch.randn(B, Hq, Tq, d, generator=g)

    def run():
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        gen = torch.Generator().manual_seed(9)
        extra = {"generator": gen} if "dropout_p" in kw else {}
        out, lse = attention(*xs, engine="cpp", return_lse=True, **kw, **extra)
        return (out, lse, *torch.autograd.grad(out, xs, dout))

    one, two = _run_threads(1, run), _run_threads(2, run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    if Tk == 2000:
        assert cpp._plan(B, Hkv, Tq, Tk)[2] > 1  # really split over keys
    if Tk == 700:
        assert cpp._lanes(B, Hkv, Tq, Tk, d, Hq // Hkv, 128) > 1


def test_decoding_splits_agree_with_one_pass_and_the_tiled_engine():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 32, generator=g)
    k, v = torch.randn(2, 2, 3000, 32, generator=g), torch.randn(2, 2, 3000, 32, generator=g)
    kw = dict(lengths=[3000, 1234], key_padding_mask=torch.rand(2, 3000, generator=g) > 0.1)
    out = attention(q, k, v, engine="cpp", **kw)
    torch.testing.assert_close(out, attention(q, k, v, engine="tiled", **kw), rtol=0, atol=2e-6)
    assert cpp._plan(2, 2, 5, 3000) == (64, 96, 8, True)  # 8 splits of 375 keys


def test_strided_and_low_precision_inputs():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 100, 3, 4, 16, generator=g)  # (B, T, qkv, H, d), as a fused projection
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))  # strided views
    want = attention(q.contiguous(), k.contiguous(), v.contiguous(), engine="tiled")
    torch.testing.assert_close(attention(q, k, v, engine="cpp"), want, rtol=0, atol=2e-6)
    for dt in (torch.bfloat16, torch.float16):
        got = attention(q.to(dt), k.to(dt), v.to(dt), engine="cpp")
        assert got.dtype == dt
        ref = attention(*(t.to(dt).double() for t in (q, k, v)), engine="reference")
        plain = contract.plain(make_problem(q.to(dt), k.to(dt), v.to(dt)), dt)
        assert _err(got, ref) <= 2 * _err(plain, ref) + 1e-3


def test_raw_passes_match_the_tiled_engine_with_a_given_global_lse():
    """What ring attention calls per block pair: fwd/bwd of a placed problem, the backward
    from a global out and lse."""
    from causalattn.masks import Pattern

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 40, 16, generator=g)
    k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    pat = Pattern(q_start=50, k_start=20, window=45)
    p = make_problem(q, k, v, pattern=pat)
    for a, b in zip(cpp.fwd(p), tiled.fwd(p)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    out, lse = tiled.fwd(p)
    lse = lse + 0.3  # as if merged with another key block
    dout = torch.randn(out.shape, generator=g)
    for a, b in zip(cpp.bwd(p, out, lse, dout), tiled.bwd(p, out, lse, dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


FALLBACK = """
    import warnings, torch, causalattn as ca
    from causalattn.engines import cpp, pick_engine, make_problem
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        q = torch.randn(1, 2, 50, 8)
        out = ca.attention(q, q, q)  # auto: the fallback
        out2 = ca.attention(q, q, q)
    torch.testing.assert_close(out, ca.attention(q, q, q, engine="reference"))
    print("engine:", pick_engine(make_problem(q, q, q)))
    print("why:", cpp.unavailable())
    print("warnings:", len([x for x in w if "engine 'cpp'" in str(x.message)]))
    try:
        ca.attention(q, q, q, engine="cpp")
    except ValueError as exc:
        print("error:", exc)
"""


def test_without_a_compiler_the_fallback_is_taken_and_named(tmp_path):
    res = _child(
        FALLBACK,
        {"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
    )
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert lines["engine"] in ("tiled", "sdpa")
    assert "no C++ compiler found" in lines["why"] and "no-such-compiler" in lines["why"]
    assert lines["warnings"] == "1"  # one line says why, once
    assert (
        lines["error"]
        == lines["why"] + "; engines that run this call: 'reference', 'sdpa', 'tiled'"
    )
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))


def test_a_failing_build_is_one_line_with_the_compilers_first_error(tmp_path):
    fake = tmp_path / "c++"  # answers for its version, fails every compile
    fake.write_text(
        "#!/bin/sh\ncase \"$*\" in *-c*) echo 'x.cpp:1:2: error: the compiler says no' >&2;"
        " exit 1;; esac\necho 'c++ (GCC) 12.2.0'\n"
    )
    fake.chmod(0o755)
    res = _child(FALLBACK, {"CXX": str(fake), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(": ", 1) for line in res.stdout.splitlines())
    assert lines["why"].startswith("engine 'cpp': the C++ extension did not build: ")
    assert lines["why"].endswith("error: the compiler says no")
    assert "Traceback" not in res.stdout and "Traceback" not in res.stderr


# bias shapes against the problem (B, H, T_q, T_k), each broadcast kind the kernel handles
# (a part per kv head or lane, the batch rows as one task) and the decoding path (T_q = 3)
BIAS_CASES = [
    # B, H, H_kv, T_q, T_k, d, bias shape, rel_bias, slopes shape, pattern keywords
    (1, 2, 2, 40, 40, 8, (1, 2, 40, 40), False, None, {}),
    (2, 4, 2, 70, 70, 16, (2, 1, 1, 70), True, (4,), {"softcap": 5.0}),
    (2, 4, 4, 33, 100, 8, (100,), True, (2, 4), {"window": 20}),
    (1, 2, 1, 3, 90, 8, (1, 2, 3, 90), True, (2,), {}),
    (2, 3, 3, 130, 130, 24, (1, 3, 130, 130), True, (3,), {"sinks": [0.5, -1.0, 2.0]}),
    (1, 2, 2, 300, 300, 8, (1, 2, 300, 1), False, None, {}),
    (2, 4, 2, 300, 300, 8, (1, 1, 300, 1), True, None, {"window": 50}),
]


def _learned_grads(engine, case, seed=1):
    B, H, H_kv, T_q, T_k, d, bshape, rel, sshape, kw = case
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    ts = [
        torch.randn(B, h, T, d, generator=g, dtype=f64)
        for h, T in ((H, T_q), (H_kv, T_k), (H_kv, T_k))
    ]
    extra = {"bias": torch.randn(*bshape, generator=g, dtype=f64)}
    if rel:
        extra["rel_bias"] = torch.randn(H, 2 * max(T_q, T_k) - 1, generator=g, dtype=f64)
    if sshape:
        extra["alibi_slopes"] = torch.rand(*sshape, generator=g, dtype=f64)
    if "sinks" in kw:
        kw = dict(kw, sinks=torch.tensor(kw["sinks"], dtype=f64))
    leaves = [t.requires_grad_() for t in ts + list(extra.values())]
    out = attention(*ts, engine=engine, **extra, **kw)
    return [out, *torch.autograd.grad(out, leaves, torch.randn(out.shape, generator=g, dtype=f64))]


@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: f"{c[6]}-rel{int(c[7])}-{c[8]}")
def test_bias_rel_bias_and_slopes_and_their_gradients_are_the_reference(case):
    """H and the gradients of q, k, v, bias (summed over its broadcast axes), rel_bias and
    ALiBi slopes, fp64, against the reference's autograd."""
    want, got = _learned_grads("reference", case), _learned_grads("cpp", case)
    for w, x in zip(want, got):
        assert w.shape == x.shape
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-10)


def test_learned_gradients_have_the_same_bits_on_one_and_two_threads():
    case = (2, 4, 2, 300, 300, 8, (1, 1, 300, 300), True, (4,), {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = _learned_grads("cpp", case)
        torch.set_num_threads(1)
        b = _learned_grads("cpp", case)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_row_that_a_minus_inf_bias_blocks_entirely_reads_nothing():
    q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(1, 1, 20, 20, dtype=torch.float64)
    bias[..., 5, :] = float("-inf")  # row 5 reads nothing; every other row its causal keys
    out = attention(q, k, v, engine="cpp", bias=bias)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    torch.testing.assert_close(out, attention(q, k, v, engine="reference", bias=bias))


def test_the_layout_constants_come_from_problem_h():
    """REL_PAD and the backward's `want` bits have one source, csrc/problem.h: the extension
    exports them, cpp.py reads them there (no Python copy)."""
    import re

    header = (cpp.CSRC / "problem.h").read_text()
    ext = cpp._ops()
    assert ext.REL_PAD == int(re.search(r"constexpr int64_t REL_PAD = (\d+);", header)[1])
    bits = dict(re.findall(r"(WANT_\w+) = (\d+)", header))
    assert set(bits) == set(cpp.WANTS.values())
    assert {n: getattr(ext, n) for n in bits} == {n: int(b) for n, b in bits.items()}
    assert not hasattr(cpp, "REL_PAD")


@pytest.mark.parametrize("env", ["default root", "TORCH_EXTENSIONS_DIR"])
def test_a_stale_build_lock_is_cleared_in_the_folder_the_build_uses(tmp_path, monkeypatch, env):
    """A killed build's lock is removed where the build runs, also under torch's default
    root (which has one folder per Python below it), and the build is told that folder."""
    import time
    import types

    from torch.utils import cpp_extension

    from causalattn import constants

    if env == "default root":
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CAUSALATTN_NO_CPP", raising=False)
    monkeypatch.setattr(cpp, "_STATE", dict(cpp._STATE))  # the mocked build stays here
    seen = {}
    built = types.SimpleNamespace(**constants.SHARED)  # a build with the shared constants
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw) or built)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    name = cpp.extension_name()
    folder = cpp.build_folder(cpp_extension, name)
    want = (
        tmp_path
        if env != "default root"
        else tmp_path / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    assert folder == want / name
    lock = folder / "lock"
    lock.touch()
    old = time.time() - cpp.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed a stale build lock"):
        assert cpp._build() == ""
    assert not lock.exists() and seen["build_directory"] == str(folder)
    lock.touch()  # a fresh lock (a build running now) is left alone
    assert cpp._build() == "" and lock.exists()


@pytest.mark.parametrize("engine", ["cpp", "tiled"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_softcap_keeps_a_nan_row_from_the_keys_and_rows_it_cannot_read(engine, where):
    """With softcap the backward multiplies dS by 1 - tanh²(S/c), and tanh of a NaN score
    is NaN at blocked cells too: those cells must stay exactly 0. A NaN query row 6 leaves
    the gradients of keys 7.. as they were; a NaN key 6 leaves the rows before it."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 13, 4, generator=g, dtype=torch.float64) for _ in range(3))

    def grads(q, k):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, engine=engine, softcap=4.0, window=9)
        return torch.autograd.grad((out * out).sum(), leaves)

    clean = grads(q, k)
    if where == "q":
        qn = q.clone()
        qn[:, :, 6] = float("nan")
        got, keep, n = grads(qn, k), slice(7, None), (1, 2)  # dk, dv of unread keys
    else:
        kn = k.clone()
        kn[:, :, 6] = float("nan")
        got, keep, n = grads(q, kn), slice(0, 6), (0,)  # dq of the rows before key 6
    for i in n:
        assert torch.isfinite(got[i][:, :, keep]).all(), (engine, where, i)
        torch.testing.assert_close(got[i][:, :, keep], clean[i][:, :, keep], atol=1e-12, rtol=0)


def test_cache_key_changes_with_what_changes_the_binary(monkeypatch):
    """The build's key (and so its folder) follows the flags and torch's path: two venvs'
    torches, or two flag sets, get two folders that coexist."""
    from causalattn.engines import cpp

    base = cpp.extension_name()
    assert base == cpp.extension_name()  # stable between calls
    monkeypatch.setattr(cpp, "FLAGS", (*cpp.FLAGS, "-DOTHER"))
    flagged = cpp.extension_name()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/torch/__init__.py")
    moved = cpp.extension_name()
    assert len({base, flagged, moved}) == 3


def test_build_progress_only_on_a_terminal():
    """The first build's line and spinner go to a terminal only; a pipe or log gets nothing."""
    import io
    import time

    from causalattn.engines import cpp

    class Tty(io.StringIO):
        def isatty(self):
            return True

    pipe, tty = io.StringIO(), Tty()
    with cpp._showing_build(True, pipe):
        pass
    with cpp._showing_build(True, tty):
        time.sleep(0.3)
    with cpp._showing_build(False, Tty()) as _:
        pass
    assert pipe.getvalue() == ""
    assert cpp.BUILDING in tty.getvalue() and "done in" in tty.getvalue()


def test_build_command_reports_compiler_flags_and_folder():
    """`causalattn build --json` (a real subprocess, not a terminal): the compiler, flags,
    key and folder of this build, and no progress line on the pipe."""
    import json
    import subprocess

    from causalattn.engines import cpp

    res = subprocess.run(
        [sys.executable, "-m", "causalattn", "build", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    info = json.loads(res.stdout)
    assert res.returncode == (0 if info["built"] else 1)
    assert info["flags"] == list(cpp.FLAGS) and info["cache_key"] == cpp.cache_key()
    assert info["folder"].endswith(cpp.extension_name())
    assert cpp.BUILDING not in res.stderr


@pytest.mark.parametrize(
    "kw", [{}, {"window": 3}, {"chunk": 3}, {"window": 4, "chunk": 3}, {"causal": False}]
)
@pytest.mark.parametrize("T_q", [7, 3])  # square, and decoding (bottom-right)
def test_the_plain_shortcut_reads_its_keywords_forward_and_backward(kw, T_q):
    """A plain call (causal, window, chunk only) takes the remembered shortcut to the
    kernels: it must give the reference's H and gradients, for each keyword and for fewer
    queries than keys, and on a second call with the same shape (the remembered one)."""
    g = torch.Generator().manual_seed(T_q)
    q = torch.randn(2, 2, T_q, 8, generator=g)
    k, v = (torch.randn(2, 1, 7, 8, generator=g) for _ in range(2))
    want = exact.forward(make_problem(q.double(), k.double(), v.double(), **kw))
    for _ in range(2):
        got = attention(q, k, v, engine="cpp", **kw)
        assert _err(got, want) < 1e-5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    attention(*leaves, engine="cpp", **kw).square().sum().backward()
    ref = exact.forward(make_problem(*leaves64, **kw))
    ref.square().sum().backward()
    for a, b in zip(leaves, leaves64):
        assert _err(a.grad, b.grad) < 1e-4


def test_learned_sinks_get_the_references_gradient_with_and_without_lse():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks0 = torch.tensor([0.5, -1.0], dtype=torch.float64)
    grads = []
    for engine in ("cpp", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks0)]
        out, lse = attention(*leaves[:3], sinks=leaves[3], engine=engine, return_lse=True)
        (out.square().sum() + lse.sin().sum()).backward()  # dout and dlse both non-zero
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert _err(a, b) < 1e-9


def test_build_info_names_what_a_build_uses():
    info = cpp.build_info()
    assert sorted(info) == ["cache_key", "compiler", "flags", "folder", "ldflags", "ninja", "torch"]
    assert info["cache_key"] == cpp.cache_key() and info["flags"] == list(cpp.FLAGS)
    assert info["torch"].startswith(torch.__version__ + " (")
    from torch.utils import cpp_extension

    assert info["folder"] == str(cpp.build_folder(cpp_extension, cpp.extension_name()))


def test_the_first_error_of_a_build_log_is_its_first_compiler_error():
    """A failed build is one line: the compiler's first error (fatal ones too), else the
    log's first line, stripped and cut at 300 characters."""
    log = "ninja: build stopped\n  a.cpp:3:1: error: first  \nb.cpp:9:9: error: second\n"
    assert cpp._first_error(log) == "a.cpp:3:1: error: first"
    assert cpp._first_error("x\n c.h:1:10: fatal error: torch.h: no such file\n") == (
        "c.h:1:10: fatal error: torch.h: no such file"
    )
    assert cpp._first_error("  linker failed \nmore") == "linker failed"
    assert cpp._first_error("") == "unknown error"
    long = "d.cpp:1:1: error: " + "x" * 400
    assert cpp._first_error("warn\n" + long) == long[:300]
    assert cpp._first_error(" " + "y" * 400) == "y" * 300


def test_build_info_names_the_compiler_that_cxx_names(tmp_path, monkeypatch):
    """The compiler a build would use: $CXX (its path when on PATH, else said so), c++ when
    CXX is unset; and whether ninja is there, as the extension API sees it."""
    import shutil

    from torch.utils import cpp_extension

    monkeypatch.setenv("CXX", str(tmp_path / "no-cc"))
    assert cpp.build_info()["compiler"] == f"{tmp_path / 'no-cc'} (not on PATH)"
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert cpp.build_info()["compiler"] == str(fake)
    monkeypatch.delenv("CXX")
    assert cpp.build_info()["compiler"] == (shutil.which("c++") or "c++ (not on PATH)")
    assert cpp.build_info()["ninja"] is bool(cpp_extension.is_ninja_available()) is True


def test_a_caller_sweeping_scales_keeps_a_few_calls_each_right(monkeypatch):
    """The shortcut keeps a Call per scale, at most 16 (a sweep over many scales does not
    grow it without bound), and each scale's H is its own."""
    import causalattn.engines as engines

    monkeypatch.setattr(engines, "_PLAIN", {})  # this shape's remembered call only
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    attention(q, k, v, engine="cpp", window=4)
    (prep,) = engines._PLAIN.values()
    assert isinstance(prep, cpp._Prepared)
    sizes = []
    for n in range(40):
        scale = 0.05 + n / 40
        got = attention(q, k, v, engine="cpp", window=4, scale=scale)
        want = exact.forward(
            make_problem(q.double(), k.double(), v.double(), window=4, scale=scale)
        )
        assert _err(got, want) < 1e-5
        sizes.append(len(prep))
    assert max(sizes) == 16 and min(sizes[16:]) < 16  # cleared when full, then refilled


@pytest.mark.parametrize("T_q", [1, 3, 16, 200])
def test_the_plain_shortcut_gives_the_general_paths_bits(T_q):
    """The remembered shortcut is the general path without its bookkeeping: the same blocks,
    the same key splits when decoding, so the same bits."""
    g = torch.Generator().manual_seed(T_q)
    q = torch.randn(1, 2, T_q, 8, generator=g)
    k, v = (torch.randn(1, 1, 1200, 8, generator=g) for _ in range(2))
    for kw in ({}, {"window": 700}):
        fast = attention(q, k, v, engine="cpp", **kw)
        general = cpp.fwd(make_problem(q, k, v, **kw))[0]
        assert torch.equal(fast, general), kw


def test_the_engine_entry_returns_lse_when_asked_and_says_why_it_cannot_run(monkeypatch):
    """``forward`` (what ``run`` calls): H, or (H, lse) with ``return_lse``, the reference's;
    a ValueError naming the device off the CPU, and the build's reason where it is not built."""
    from causalattn.engines import run

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64) for _ in range(3))
    p = make_problem(q, k, v, window=6)
    out, lse = run(p, "cpp", return_lse=True)
    want, want_lse = run(p, "reference", return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(cpp.forward(p), out)
    meta = make_problem(*(t.to("meta") for t in (q, k, v)))
    with pytest.raises(ValueError, match=r"^engine 'cpp': runs on the CPU; q is on meta$"):
        cpp.forward(meta)
    monkeypatch.setitem(cpp._STATE, "why", "engine 'cpp': not built here")
    with pytest.raises(ValueError, match=r"^engine 'cpp': not built here$"):
        cpp.forward(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_raw_backward_reads_out_dout_and_lse_in_any_float_dtype(dtype):
    """A caller that merged out and lse over key blocks may hold them wider than q (ring
    attention keeps fp32): the backward reads them in q's and the compute dtype, and its
    gradients are those of the narrow ones, in q's dtype."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g).to(dtype) for _ in range(3))
    p = make_problem(q, k, v, window=15)
    out, lse = cpp.fwd(p)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g)
    narrow = cpp.bwd(p, out, lse, dout, dlse)
    wide = cpp.bwd(p, out.double(), lse.double(), dout.double(), dlse.double())
    for a, b in zip(narrow, wide):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)


def test_an_unbuilt_engine_is_refused_on_the_cpu_and_not_asked_on_meta(monkeypatch):
    """Where the extension is not built, a CPU call's refusal says why (and "auto" leaves the
    engine out); on meta tensors (tracing: shapes only, nothing runs) the build is not asked."""
    from causalattn.engines import registry

    q = torch.randn(1, 2, 5, 4)
    monkeypatch.setitem(cpp._STATE, "why", "engine 'cpp': not built here")
    registry._refusal.cache_clear()
    try:
        cpu = registry.features(q, q, q, tensors={})
        assert registry.refusal("cpp", cpu).startswith(
            "engine 'cpp': not built here; engines that run this call: "
        )
        assert "cpp" not in registry.runs(cpu)
        m = q.to("meta")
        assert registry.refusal("cpp", registry.features(m, m, m, tensors={})) == ""
    finally:
        registry._refusal.cache_clear()


def test_the_kernels_own_checks_stay_runtime_errors():
    """Only a captured tensor's out-of-range index is the user's error (a ValueError); the
    kernels' checks of what Python hands them stay RuntimeErrors, raised, never swallowed."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    p = make_problem(q, k, v)
    out, lse = cpp.fwd(p)
    with pytest.raises(RuntimeError, match=r"lse must be \(B, H_q, T_q\)"):
        cpp.bwd(p, out, lse[..., :-1], torch.ones_like(out))


def test_a_float32_rel_bias_with_float64_qkv_is_read_in_float64():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 10, 4, generator=g, dtype=torch.float64) for _ in range(3))
    rel = torch.randn(2, 19, generator=g)
    got = attention(q, k, v, rel_bias=rel, engine="cpp")
    want = attention(q, k, v, rel_bias=rel.double(), engine="reference")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(9, 9), (2, 9, 9), (2, 1, 9, 9)])
def test_a_dense_mask_of_two_three_or_four_axes_alone(shape):
    """A dense mask with nothing else: read in tiles, broadcast from the axes it has."""
    g = torch.Generator().manual_seed(len(shape))
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(*shape, generator=g) > 0.3
    got = attention(q, k, v, mask=mask, engine="cpp")
    want = attention(q, k, v, mask=mask, engine="reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("modifier", ["alibi_slopes", "rel_bias"])
def test_a_placed_block_reads_its_positions_in_the_modifiers(modifier):
    """A block pair placed at q_start, k_start (ring attention's): ALiBi and rel_bias read
    the global positions, as the reference does."""
    from causalattn.engines import run
    from causalattn.masks import Pattern

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    table = {
        "alibi_slopes": torch.rand(2, generator=g),
        "rel_bias": torch.randn(2, 41, generator=g),
    }
    pt = Pattern(q_start=8, k_start=5, **{modifier: table[modifier].double()})
    got = run(make_problem(q, k, v, pattern=pt), "cpp")
    want = run(make_problem(q, k, v, pattern=pt), "reference")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
