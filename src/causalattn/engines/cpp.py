"""The native CPU engine (``engine="cpp"``): fused C++ tiles through PyTorch's extension API.

The sources in ``csrc/`` are compiled on first use against the installed torch
(``torch.utils.cpp_extension``, with ``-O3 -march=native``: built where it runs) and cached
in torch's extension folder (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
Nothing binary is downloaded. Where no C++ compiler (or ninja) is found, or the build fails,
the engine is unavailable: :func:`unavailable` says why in one line, and "auto" runs the
others.

Forward: one fused pass per (batch row, kv head, block of bq query rows): the Q Kᵀ tile (a
register-blocked micro-kernel over K packed once per call), scale, softcap, ALiBi, the
pattern, the online softmax with sinks, dropout from :mod:`causalattn.dropout`'s hash (bit
for bit), P V, and the log-sum-exp; tasks in a fixed order on ``at::parallel_for``'s
threads, each task's result independent of the thread that runs it. Decoding (at most
``DECODE_ROWS`` query rows) is split over keys, K and V read in place, the splits merged in
order. Backward by recomputation from the saved lse: per (batch row, kv head, lane) the
lane's key blocks, dS = P ∘ (dP − D) fused, dQ summed over a fixed number of lanes in order:
no atomics, the same bits on any thread count.

Who may read whom comes from :class:`causalattn.masks.Pattern` as data: the per-row
intervals (:meth:`~causalattn.masks.Pattern.row_ranges`), the key padding vector, the dense
mask's tile kinds (:meth:`~causalattn.masks.Pattern.mask_tile_kinds`) with the mask read
only in partial tiles. The C++ states no rule of its own. Compute in fp32 (fp64 for fp64
inputs, so gradcheck runs on the native code); bf16 and fp16 are converted while packing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import constants as _constants
from .. import dropout as _dropout
from ..constants import LOG2E
from . import autograd as _autograd
from .problem import Problem, compute_dtype
from .registry import captured_of

SOURCES = ("ops.cpp", "forward.cpp", "backward.cpp")
CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _literal(value) -> str:
    """A constant as a C++ literal: a double by its shortest repr (it reads back exactly), an
    integer as an unsigned hex (the hash's uint32 multipliers)."""
    return repr(value) if isinstance(value, float) else f"{value:#x}u"


# causalattn/constants.py's constants, the one definition, handed to the compiler
DEFINES = tuple(f"-DCAUSALATTN_{n}={_literal(v)}" for n, v in _constants.SHARED.items())
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = "fp64, fp32, bf16 or fp16"
DTYPE_NAMES_OF = tuple(str(t).replace("torch.", "") for t in DTYPES)
DECODE_ROWS = 16  # query rows at most for the key-split decoding path
BLOCKS: tuple[int, int] | None = None  # (bq, bk) to force, for tests
BWD_BLOCKS = (64, 96)  # backward (query rows, keys) per step; must divide the grid's

_STATE: dict = {}


def _machine_tag() -> str:
    """This CPU (-march=native builds for it): its architecture, model and flags, hashed."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            info = fh.read()
        cpu += "".join(ln for ln in info.splitlines() if ln.startswith(("flags", "model name")))
    except OSError:
        cpu += platform.processor()
    return hashlib.sha1(cpu.encode()).hexdigest()[:12]


def cache_key() -> str:
    """The build's cache key: a hash of everything that changes the binary, the sources'
    bytes (headers too), the flags, the torch built against (version AND path: two venvs'
    torches of one version are different libraries), Python's version and this CPU. Builds
    of different keys get different folders, so two checkouts or venvs never rebuild over
    each other (torch's own key, within one folder, replaces the older build)."""
    h = hashlib.sha1()
    for src in sorted(CSRC.iterdir()):
        if src.suffix in (".cpp", ".h"):
            h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update("|".join((*FLAGS, *DEFINES, *LDFLAGS)).encode())
    h.update(f"|{torch.__version__}|{os.path.realpath(torch.__file__)}".encode())
    h.update(f"|{platform.python_version()}|{_machine_tag()}".encode())
    return h.hexdigest()[:16]


def extension_name() -> str:
    """The extension's module (and build folder) name: its cache key in it."""
    return f"causalattn_cpp_{cache_key()}"


def _first_error(text: str) -> str:
    """The compiler's first error line of a failed build's log (else its first line)."""
    lines = text.splitlines()
    for line in lines:
        if ": error:" in line or ": fatal error:" in line:
            return line.strip()[:300]
    return (lines or ["unknown error"])[0].strip()[:300]


def unavailable() -> str:
    """Why the engine cannot run here ("" when it can); builds the extension on first call."""
    why = _STATE.get("why")
    if why is None:
        why = _STATE["why"] = _build()
        if why and not os.environ.get("CAUSALATTN_NO_CPP"):  # one line says why, once
            warnings.warn(f"{why}; 'auto' runs the other engines", RuntimeWarning, stacklevel=2)
    return why


def _build() -> str:
    if os.environ.get("CAUSALATTN_NO_CPP"):
        return "engine 'cpp': disabled by CAUSALATTN_NO_CPP"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"engine 'cpp': no C++ compiler found ({cxx!r} is not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "engine 'cpp': the ninja build tool is not installed (pip install ninja)"
    name = extension_name()
    folder = build_folder(cpp_extension, name)
    _clear_stale_lock(folder / "lock")
    built = any(folder.glob(f"{name}*.so"))  # loading a built one takes a second
    with _showing_build(not built):
        try:
            _STATE["ext"] = cpp_extension.load(
                name=name,
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=[*FLAGS, *DEFINES],
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build failure leaves the engine unavailable
            return f"engine 'cpp': the C++ extension did not build: {_first_error(str(exc))}"
    return _disagreeing(_STATE["ext"])


def _disagreeing(ext) -> str:
    """Empty when the extension was compiled with causalattn/constants.py's values (exported
    as module attributes), else which differ: it would compute with other numbers."""
    off = [n for n, v in _constants.SHARED.items() if getattr(ext, n, None) != v]
    return (
        f"engine 'cpp': the extension was built with other constants ({', '.join(off)})"
        if off
        else ""
    )


BUILDING = "building the native engine (first use, about 1-2 minutes)"


@contextlib.contextmanager
def _showing_build(compiling: bool, stream=None):
    """While the extension compiles: on a terminal, one line and a spinner with the seconds
    so far on ``stream`` (stderr), then the time it took; nothing when it is not a terminal
    (logs, pipes, tests) or when nothing compiles."""
    stream = stream if stream is not None else sys.stderr
    if not compiling or not stream.isatty():
        yield
        return
    done = threading.Event()
    t0 = time.perf_counter()

    def spin() -> None:
        for ch in itertools.cycle("|/-\\"):
            stream.write(f"\r{BUILDING}… {ch} {time.perf_counter() - t0:.0f} s")
            stream.flush()
            if done.wait(0.25):
                return

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()
        stream.write(f"\r{BUILDING}: done in {time.perf_counter() - t0:.0f} s\n")
        stream.flush()


def build_info() -> dict:
    """What a build uses and where it goes: the compiler (its path), the flags, torch's
    version and path, the cache key and the build folder (made, not built)."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    name = extension_name()
    return {
        "compiler": shutil.which(cxx) or f"{cxx} (not on PATH)",
        "ninja": bool(cpp_extension.is_ninja_available()),
        "flags": list(FLAGS),
        "ldflags": list(LDFLAGS),
        "torch": f"{torch.__version__} ({os.path.dirname(os.path.realpath(torch.__file__))})",
        "cache_key": cache_key(),
        "folder": str(build_folder(cpp_extension, name)),
    }


STALE_LOCK_S = 900.0  # a build takes minutes; a lock this old was left by a killed one


def build_folder(cpp_extension, name: str) -> Path:
    """The extension's build folder, named here (and handed to ``load``) so that the lock
    check below looks where the build runs: ``$TORCH_EXTENSIONS_DIR/<name>``, else torch's
    default root, one folder per Python (torch's own default adds that level too)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(),
        f"py{sys.version_info.major}{sys.version_info.minor}_cpu",
    )
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _clear_stale_lock(lock: Path) -> None:
    """Remove the build folder's ``lock`` when a killed build left it: torch waits on it
    forever otherwise (every later first call would hang)."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            warnings.warn(
                f"engine 'cpp': removed a stale build lock ({lock})", RuntimeWarning, stacklevel=2
            )
    except FileNotFoundError:
        pass


def build_from_nothing(timeout_s: float = 900.0) -> tuple[float | None, str]:
    """(seconds, "") to build the extension in a fresh, empty extension folder and load it,
    in a subprocess (what a new user's first call pays); (None, why) when it fails."""
    import subprocess
    import tempfile

    code = "from causalattn.engines import cpp; print(cpp.unavailable())"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=tmp)
        t0 = time.perf_counter()
        try:
            res = subprocess.run(
                [sys.executable, "-c", code],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return None, f"no build within {timeout_s:.0f} s"
        seconds = time.perf_counter() - t0
    why = (res.stdout.strip().splitlines() or [""])[-1] if res.returncode == 0 else res.stderr
    return (seconds, "") if res.returncode == 0 and not why else (None, why.strip()[:300])


def _ops():
    why = unavailable()
    if why:
        raise ValueError(why)
    return _STATE["ext"]


# ---- the pattern as the kernels read it ----------------------------------------------------
def blocks(B: int, H_kv: int, T_q: int) -> tuple[int, int]:
    """(query rows per block, keys per tile): the forward's blocks and the grid of tile kinds.
    Tall blocks reuse each K, V tile over more queries (measured best on a 2-core AVX2
    machine); shorter ones where there would be too few tasks for the threads."""
    if BLOCKS is not None:
        return BLOCKS
    bq = 256
    while bq > 64 and B * H_kv * -(-T_q // bq) < 8:
        bq //= 2
    return bq, 96  # bk: a multiple of the micro-kernel's 6 rows and 16 columns


@functools.lru_cache(maxsize=32)
def _scalar_intervals(causal, window, chunk, q_start, k_start, T_q, T_k):
    """lo, hi (1, T_q) for a pattern without per-batch or document data (the common case:
    computed once per shape, not per call)."""
    from ..masks import Pattern

    pt = Pattern(causal=causal, window=window, chunk=chunk, q_start=q_start, k_start=k_start)
    lo, hi = pt.row_ranges(T_q, T_k)
    return (torch.from_numpy(np.ascontiguousarray(lo)), torch.from_numpy(np.ascontiguousarray(hi)))


def _intervals(p: Problem):
    pt = p.pattern
    B, _, T_q, T_k = p.dims
    if pt.lengths is None and pt.prefix_lengths is None and pt.cu_seqlens is None:
        return _scalar_intervals(pt.causal, pt.window, pt.chunk, pt.q_start, pt.k_start, T_q, T_k)
    lo, hi = pt.row_ranges(T_q, T_k)
    return torch.from_numpy(np.ascontiguousarray(lo)), torch.from_numpy(np.ascontiguousarray(hi))


def _call(**fields):
    """The extension's ``Call`` (csrc/ops.cpp) with these fields set; None leaves a field at
    its default (none, off)."""
    c = _ops().Call()
    for name, value in fields.items():
        if value is not None:
            setattr(c, name, value)
    return c


def _pattern_call(p: Problem, bq: int, bk: int, **more):
    """The kernels' ``Call`` of the pattern and the modifiers (and ``more`` fields)."""
    pt = p.pattern
    B, H, T_q, T_k = p.dims
    lo, hi = _intervals(p)
    key_padding = pt.key_padding_mask
    if key_padding is not None:
        key_padding = torch.as_tensor(key_padding).to("cpu", torch.bool).contiguous()
    kinds = mask = tile_masks = None
    if pt.mask_mod is not None and pt.mask is None:  # as intervals, bits where they fall short
        lo, hi, kinds, tile_masks = _mod_rows(p, bq, bk, lo, hi)
    elif pt.mask_mod is not None:  # mask AND mask_mod, tile by tile: partial tiles as tile masks
        kinds, tile_masks = _tiles(p, bq, bk, lo, hi)
    elif pt.mask is not None:
        kinds = pt.mask_tile_kinds(bq, bk).to(torch.int32)
        m = torch.as_tensor(pt.mask).to("cpu")
        mask = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).contiguous()
    slopes = sinks = None
    if pt.alibi_slopes is not None:
        s = torch.as_tensor(_host(pt.alibi_slopes), dtype=torch.float64)
        slopes = (s[None] if s.dim() == 1 else s).contiguous()
    if pt.sinks is not None:
        sinks = torch.as_tensor(_host(pt.sinks), dtype=torch.float64).contiguous()
    bias, rel = _additive(p)
    thr, drop_scale, seed, offset = 0, 1.0, 0, 0
    if p.dropout_p > 0:
        thr = _dropout.threshold(p.dropout_p)
        drop_scale = 0.0 if p.dropout_p >= 1 else 1.0 / (1.0 - p.dropout_p)
        seed, offset = p.dropout_seed
    return _call(
        lo=lo,
        hi=hi,
        key_padding=key_padding,
        kinds=kinds,
        mask=mask,
        tile_masks=tile_masks,
        slopes=slopes,
        sinks=sinks,
        bias=bias,
        rel=rel,
        scale=float(p.scale),
        softcap=float(pt.softcap or 0.0),
        q_start=int(pt.query_start(T_q, T_k)),
        k_start=int(pt.k_start),
        drop_thr=int(thr),
        drop_scale=float(drop_scale),
        seed=int(seed),
        offset=int(offset),
        bq=bq,
        bk=bk,
        **more,
    )


def _additive(p: Problem):
    """(bias, rel) as the kernels read them, in the compute dtype: bias as a 4-D view
    (1|B, 1|H_q, 1|T_q, 1|T_k) (no copy when it is already fp32 / fp64); rel_bias (H_q, R)
    times log2 e, each row reversed between REL_PAD zeros (csrc/problem.h's, which the
    extension exports: its one source)."""
    pt, ct = p.pattern, compute_dtype(p.q.dtype)
    bias = rel = None
    if pt.bias is not None:
        b = torch.as_tensor(_host(pt.bias)).to(ct)
        bias = b.reshape((1,) * (4 - b.dim()) + tuple(b.shape))
    if pt.rel_bias is not None:
        r = torch.as_tensor(_host(pt.rel_bias), dtype=torch.float64) * LOG2E
        pad = _ops().REL_PAD
        rel = torch.nn.functional.pad(r.flip(-1), (pad, pad)).to(ct).contiguous()
    return bias, rel


def _tiles(p: Problem, bq: int, bk: int, lo, hi):
    """(kinds, tile_masks) of the dense mask AND the mask_mod on the (bq, bk) grid: a
    mask_mod's from its kept table (:func:`causalattn.masks_table.kept_tiles`: made once,
    across calls, forward and backward), kept on the pattern per grid too."""
    from ..masks_table import kept_tiles

    B, H, T_q, T_k = p.dims
    cache = p.pattern.__dict__.setdefault("_tile_tables", {})
    key = (B, H, T_q, T_k, bq, bk)
    if key not in cache:
        cache[key] = kept_tiles(p.pattern, B, H, T_q, T_k, bq, bk, lo.numpy(), hi.numpy())
    return cache[key]


def _mod_rows(p: Problem, bq: int, bk: int, lo, hi) -> tuple:
    """(lo, hi, kinds, tile_masks) of a mask_mod (no dense mask) AND the keyword intervals:
    the rule as per-row intervals, with kinds only where it has holes inside them
    (:func:`causalattn.masks_rows.row_form`: made once per problem, kept with its table)."""
    from ..masks_rows import row_form

    B, H, T_q, T_k = p.dims
    return row_form(p.pattern, B, H, T_q, T_k, bq, bk, lo.numpy(), hi.numpy())[:4]


def _host(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else np.asarray(x)


def _splits(B: int, H_kv: int, T_k: int) -> int:
    """Key splits per (b, kv head) when decoding: enough tasks for the cores of a large
    machine, at least 256 keys each; fixed by the shape (the merge order is the split order)."""
    return int(max(1, min(-(-32 // max(1, B * H_kv)), T_k // 256)))


def _lanes(B: int, H_kv: int, T_q: int, T_k: int, d_k: int, g: int, bk: int) -> int:
    """dQ partial sums per (b, kv head) in the backward: enough tasks (B·H_kv·lanes >= 16)
    within 64 MiB of partial sums; fixed by the shape, never by the thread count."""
    want = -(-16 // max(1, B * H_kv))
    per_lane = B * H_kv * g * T_q * max(1, d_k) * 4
    return int(max(1, min(want, -(-T_k // bk), (64 << 20) // max(1, per_lane))))


@functools.lru_cache(maxsize=256)
def _plan(B: int, H_kv: int, T_q: int, T_k: int) -> tuple[int, int, int, bool]:
    """(bq, bk, splits, decode) of a forward: fixed by the shape."""
    bq, bk = blocks(B, H_kv, T_q)
    decode = T_q <= min(DECODE_ROWS, bq)
    return bq, bk, (_splits(B, H_kv, T_k) if decode else 1), decode


def fwd(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward without autograd: ``(out (B, H_q, T_q, d_v) in q's dtype, lse (B, H_q, T_q))``,
    lse fp32 (fp64 for fp64 inputs), -inf with a zero out row where no key is readable."""
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))  # any strides
    B, H, T_q, T_k = p.dims
    bq, bk, splits, decode = _plan(B, k.shape[1], T_q, T_k)
    smod = _smod_fields(p)
    if smod:  # a score_mod runs on blocks (the decoding path has none)
        bq, bk = blocks(B, k.shape[1], T_q)
        splits, decode = 1, False
    call = _pattern_call(p, bq, bk, splits=splits, decode=decode, **smod)
    with _index_errors():
        return _ops().fwd(q, k, v, call)


# ---- the score_mod as a program (causalattn.engines.score_program) --------------------------
def _smod_fields(p: Problem, grad: tuple = ()) -> dict:
    """The ``Call``'s ``smod_*`` fields of the pattern's score_mod (code, consts, data, meta,
    out, regs, grad bits; {} without one); ``grad``: the tensors whose gradients are wanted.
    A score_mod that returned the wrong shape or dtype, or no tensor, is named here."""
    fn = p.pattern.score_mod
    if fn is None:
        return {}
    from .score_program import program

    prog = program(fn)
    if prog.error:
        raise ValueError(f"{prog.error} (engine 'cpp')")
    if prog.why:  # refusal() said so before a Problem was built; a direct call lands here
        raise ValueError(f"engine 'cpp': {prog.why}; engines that run it: 'tiled', 'reference'")
    if not prog.code and prog.out == 0:
        return {}  # the identity
    code, consts, data, meta = prog.arrays(compute_dtype(p.q.dtype))
    bits = sum(1 << i for i, t in enumerate(prog.tables) if any(t is g for g in grad))
    return dict(
        smod_code=code,
        smod_consts=consts,
        smod_data=data,
        smod_meta=meta,
        smod_out=prog.out,
        smod_regs=prog.regs,
        smod_grad=bits,
    )


class _index_errors:
    """The kernels' out-of-range index of a captured tensor as a ValueError (their one
    runtime error that is the user's)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is RuntimeError and "score_mod:" in str(exc):
            msg = str(exc)[str(exc).index("score_mod:") :].splitlines()[0]
            raise ValueError(f"{msg} (engine 'cpp')") from None
        return False


def prepare(q, k, causal: bool, window, chunk, grad: bool):
    """A plain call's prepared arguments (remembered by :func:`causalattn.attention` per
    shape): for a call with causal, window and chunk only, bottom-right."""
    B, _, T_q, _ = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    if grad:  # a Problem per call, through the autograd wiring
        return _scalar_pattern(causal, window, chunk)
    lo, hi = _scalar_intervals(causal, window, chunk, None, 0, T_q, T_k)
    bq, bk, splits, decode = _plan(B, H_kv, T_q, T_k)
    return _Prepared(lo=lo, hi=hi, q_start=T_k - T_q, bq=bq, bk=bk, splits=splits, decode=decode)


class _Prepared(dict):
    """A plain call's ``Call`` per scale (made on the first call with it: a call then only
    looks its Call up), from the fields :func:`prepare` chose."""

    __slots__ = ("fields",)

    def __init__(self, **fields):
        super().__init__()
        self.fields = fields

    def __missing__(self, scale: float):
        if len(self) >= 16:  # a caller sweeping scales: keep a few
            self.clear()
        call = self[scale] = _call(scale=scale, **self.fields)
        return call


def plain(q, k, v, prep, scale: float):
    """H for checked q, k, v from :func:`prepare`'s arguments: the shortest path from
    :func:`causalattn.attention` to the kernel (no Problem) when nothing needs a gradient."""
    if type(prep) is not _Prepared:
        return forward(Problem(q, k, v, scale, prep))
    return _STATE["ext"].fwd(q, k, v, prep[scale])[0]


@functools.lru_cache(maxsize=64)
def _scalar_pattern(causal, window, chunk):
    from ..masks import Pattern

    return Pattern(causal=causal, window=window, chunk=chunk)


def bwd(p: Problem, out, lse, dout, dlse=None):
    """FlashAttention-2 backward from the GIVEN ``out`` and ``lse`` (possibly global, merged
    over key blocks): ``(dq, dk, dv)`` in the inputs' dtypes, dk, dv summed over each
    query-head group. Rows with lse = -inf get zero gradient; dropout is regenerated."""
    return tuple(_bwd(p, out, lse, dout, dlse, 0)[:3])


# the learned tensors the kernels differentiate, by the name of their bit of the backward's
# `want` (csrc/problem.h's WANT_*, which the extension exports: their one source)
WANTS = {"alibi_slopes": "WANT_SLOPES", "bias": "WANT_BIAS", "rel_bias": "WANT_REL"}


def bwd_grads(p: Problem, out, lse, dout, dlse, want: tuple[str, ...]):
    """``(dq, dk, dv, {name: grad})`` with the gradients of the learned tensors in ``want``
    (names of :data:`WANTS`), computed in the backward's tiles from dZ = P∘(dP − D):
    d bias = dZ summed over bias's broadcast axes, d rel_bias[h, r] = Σ dZ along relative
    position r, d slopes = −Σ dZ·|pos(i) − j|. Each task adds in its fixed order, tasks that
    share cells run as one or into separate parts summed in part order: the same bits
    whatever the thread count."""
    bits = sum(getattr(_ops(), WANTS[n]) for n in want if n in WANTS)
    caps = captured_of(p.pattern.score_mod) if "captured" in want else []
    dq, dk, dv, dsl, dz, drel, dtab = _bwd(p, out, lse, dout, dlse, bits, caps)
    pt, grads = p.pattern, {}
    if "captured" in want:
        grads["captured"] = _table_grads(p, caps, dtab)
    if "bias" in want:  # summed over its broadcast axes in the kernel (its 4-D form)
        grads["bias"] = dz.reshape(tuple(pt.bias.shape))
    if "rel_bias" in want:
        grads["rel_bias"] = drel
    if "alibi_slopes" in want:
        grads["alibi_slopes"] = dsl.reshape(tuple(pt.alibi_slopes.shape))
    return dq, dk, dv, grads


def _table_grads(p: Problem, caps: list, dtab: torch.Tensor) -> list:
    """The gradient of each captured tensor (in order) from the kernels' flat table sums."""
    from .score_program import program

    tables = program(p.pattern.score_mod).tables
    out, off = [], {}
    n = 0
    for t in tables:
        off[id(t)] = n
        n += t.numel()
    for c in caps:
        if id(c) in off and dtab.numel():
            out.append(dtab[off[id(c)] : off[id(c)] + c.numel()].reshape(c.shape).clone())
        else:  # reachable, never read
            out.append(torch.zeros(c.shape, dtype=dtab.dtype))
    return out


def _bwd(p: Problem, out, lse, dout, dlse, want: int, caps: tuple = ()) -> list:
    q, k, v = (t.detach() for t in (p.q, p.k, p.v))  # any strides
    B, H, T_q, T_k = p.dims
    bq, bk, _, _ = _plan(B, k.shape[1], T_q, T_k)
    dt = p.q.dtype
    out = out.detach().to(dt)
    dout = dout.detach().to(dt)
    lse = lse.detach().to(compute_dtype(dt)).contiguous()
    if dlse is not None:
        dlse = dlse.detach().to(compute_dtype(dt)).contiguous()
    lanes = _lanes(B, k.shape[1], T_q, T_k, q.shape[-1], p.group, bk)
    call = _pattern_call(
        p,
        bq,
        bk,
        bwd_q=BWD_BLOCKS[0],
        bwd_k=BWD_BLOCKS[1],
        lanes=lanes,
        want=want,
        **_smod_fields(p, tuple(caps)),
    )
    with _index_errors():
        return _ops().bwd(q, k, v, out, dout, lse, dlse, call)


def sinks_grad(p: Problem, out, lse, dout, dlse=None) -> torch.Tensor:
    """d sinks (H_q,) from out, lse and dout (O(B·H·T·d), see :func:`tiled.sinks_grad`)."""
    from .tiled import sinks_grad as _sinks_grad

    return _sinks_grad(p, out, lse, dout, dlse)


def supports(f) -> str | None:
    """What the registry's data cannot say (it holds the dtypes): None when the native
    kernels run ``f`` here, else why — a score_mod with no traced program
    (:mod:`.score_program`, named with the reason), or no build here."""
    if f.score_mod and f.score_mod_why:
        return f"{f.score_mod_why}, so it cannot run in the native kernels"
    return (unavailable() or None) if f.device == "cpu" else None


def forward(p: Problem, return_lse: bool = False):
    """Engine entry: differentiable in q, k, v and learned sinks (:mod:`.autograd`)."""
    if p.q.device.type != "cpu":
        raise ValueError(f"engine 'cpp': runs on the CPU; q is on {p.q.device}")
    why = unavailable()
    if why:
        raise ValueError(why)
    return _autograd.forward(sys.modules[__name__], p, return_lse)
