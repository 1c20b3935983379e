"""A score_mod as a small expression program the native kernels interpret per tile.

``score_mod(score, b, h, q_idx, kv_idx)`` is traced once (``torch.fx.symbolic_trace``) into
a straight-line program over registers: inputs 0..4 are score, b, h, q_idx, kv_idx; each
instruction ``(op, dst, a0, a1, a2, a3, aux)`` writes one register from earlier ones —
elementwise arithmetic, comparisons, ``where``, a few functions, constants (``aux`` indexes
``consts``) and reads of a captured tensor (GATHER: ``aux`` the table, ``a0..a3`` the index
registers, -1 unused; a one-element tensor read as a value takes no index). The kernels run
it on a panel of query columns for one key at a time, in the compute dtype, and its reverse
sweep gives d score and the captured tensors' gradients (csrc/score_mod.h).

:func:`program` caches the result per function (by identity, the function kept alive by the
cache). What the tracer cannot express (Python control flow on the arguments, other ops,
tensors of more than four axes) is named in ``why``: the call then runs on "tiled". The
program is checked against the function itself on a small example tile (float64), so a
wrong translation never runs; a score_mod that returns another shape or dtype, or not a
tensor, is recorded in ``error`` (a ValueError at the call, naming the engine); one that
changes the dtype at one compute dtype only (a float64 table over float32 scores) in
``dtype_faults``, raised for that dtype alone (nothing is cast back).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

# op codes (csrc/score_mod.h's, in the same order)
OPS = (
    "const", "add", "sub", "mul", "div", "neg", "tanh", "exp", "log", "abs", "sqrt", "pow",
    "sin", "cos", "where", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "gather",
    "sigmoid", "max", "min", "floordiv", "mod",
)  # fmt: skip
OP = {n: i for i, n in enumerate(OPS)}
N_INPUTS = 5
MAX_REGS = 64

_BINARY = {
    operator.add: "add", torch.add: "add", "add": "add",
    operator.sub: "sub", torch.sub: "sub", "sub": "sub",
    operator.mul: "mul", torch.mul: "mul", "mul": "mul",
    operator.truediv: "div", torch.div: "div", "div": "div", torch.true_divide: "div",
    operator.lt: "lt", torch.lt: "lt", "lt": "lt",
    operator.le: "le", torch.le: "le", "le": "le",
    operator.gt: "gt", torch.gt: "gt", "gt": "gt",
    operator.ge: "ge", torch.ge: "ge", "ge": "ge",
    operator.eq: "eq", torch.eq: "eq", "eq": "eq",
    operator.ne: "ne", torch.ne: "ne", "ne": "ne",
    operator.and_: "and", torch.logical_and: "and", "logical_and": "and",
    operator.or_: "or", torch.logical_or: "or", "logical_or": "or",
    torch.maximum: "max", "maximum": "max", torch.minimum: "min", "minimum": "min",
    operator.floordiv: "floordiv", operator.mod: "mod", torch.remainder: "mod",
}  # fmt: skip
_UNARY = {
    operator.neg: "neg", torch.neg: "neg", "neg": "neg",
    torch.tanh: "tanh", "tanh": "tanh", torch.exp: "exp", "exp": "exp",
    torch.log: "log", "log": "log", torch.abs: "abs", "abs": "abs", operator.abs: "abs",
    torch.sqrt: "sqrt", "sqrt": "sqrt", torch.sin: "sin", "sin": "sin",
    torch.cos: "cos", "cos": "cos", torch.sigmoid: "sigmoid", "sigmoid": "sigmoid",
    operator.invert: "not", torch.logical_not: "not", "logical_not": "not",
}  # fmt: skip


@dataclass
class Program:
    """A traced score_mod: ``code`` int64 (n, 7), ``consts`` float64, ``tables`` the tensors
    it reads (the captured objects themselves), ``out`` the result register; ``why`` why it
    could not be traced ("" when it was), ``error`` what the function did wrong (""),
    ``dtype_faults`` what it does wrong at one compute dtype only (raised by :meth:`arrays`)."""

    code: list = field(default_factory=list)
    consts: list = field(default_factory=list)
    tables: list = field(default_factory=list)
    out: int = 0
    regs: int = N_INPUTS
    why: str = ""
    error: str = ""
    dtype_faults: dict = field(default_factory=dict)  # compute dtype -> the dtype it returned

    def arrays(self, dtype) -> tuple:
        """(code int64 (n, 8) with each instruction's ``varies`` flag — it reads the score or
        kv_idx, directly or not —, consts float64, the tables flat in ``dtype``, their meta
        int64 (tables, 10): offset, dims, sizes, strides), as the kernels read them. A
        function that changes scores of this dtype to another is refused (never cast back)."""
        if dtype in self.dtype_faults:
            raise ValueError(self.dtype_faults[dtype])
        varies = {0, 4}
        code = []
        for op, d, a0, a1, a2, a3, aux in self.code:
            v = any(a in varies for a in (a0, a1, a2, a3) if a >= 0)
            if v:
                varies.add(d)
            code.append([op, d, a0, a1, a2, a3, aux, int(v)])
        flat, meta, off = [], [], 0
        for t in self.tables:
            x = t.detach().to("cpu", dtype).contiguous()
            sizes = list(x.shape) + [1] * (4 - x.dim())
            strides = list(x.stride()) + [0] * (4 - x.dim())
            meta.append([off, x.dim(), *sizes, *strides])
            flat.append(x.reshape(-1))
            off += x.numel()
        data = torch.cat(flat) if flat else torch.zeros(1, dtype=dtype)
        return (
            torch.tensor(code, dtype=torch.int64).reshape(-1, 8),
            torch.tensor(self.consts or [0.0], dtype=torch.float64),
            data,
            torch.tensor(meta, dtype=torch.int64).reshape(-1, 10),
        )


class _Refuse(Exception):
    pass


_CACHE: dict[int, tuple] = {}


def program(fn) -> Program:
    """The traced program of ``fn``, made once per function object."""
    hit = _CACHE.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    prog = _make(fn)
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[id(fn)] = (fn, prog)
    return prog


def refused(fn) -> str:
    """Why the native kernels do not run ``fn`` ("" when they do)."""
    return "" if fn is None else program(fn).why


def _make(fn) -> Program:
    from ..masks_mod import name_of

    error, dtype_faults = _example_error(fn)
    if error:
        return Program(error=error)
    try:
        gm = torch.fx.symbolic_trace(fn)
        prog = _compile(gm)
    except _Refuse as exc:
        return Program(why=f"score_mod {name_of(fn)}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure to trace leaves it to "tiled"
        return Program(why=f"score_mod {name_of(fn)} could not be traced ({type(exc).__name__})")
    if not _agrees(fn, prog):
        return Program(why=f"score_mod {name_of(fn)}: its traced program differs from it")
    prog.dtype_faults = dtype_faults
    return prog


def _example(dtype, T=7, H=1):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, H, T, T + 2, generator=g, dtype=dtype)
    b = torch.arange(1).view(1, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(2, T + 2).view(1, 1, T, 1)
    kv = torch.arange(T + 2).view(1, 1, 1, T + 2)
    return s, b, h, q, kv


def _example_error(fn) -> tuple[str, dict]:
    """The function's own fault on float32 and float64 example tiles ("" when none), and the
    dtype it changes the scores to where it does so at one compute dtype only (a captured
    tensor of a wider dtype promotes float32 scores): {compute dtype: the fault there}."""
    from ..masks_mod import apply_score_mod

    faults = {}
    for dt in (torch.float32, torch.float64):
        try:
            with torch.no_grad():
                apply_score_mod(fn, *_example(dt))
        except ValueError as exc:
            if " raised " in str(exc):  # on the example's indices: its fault on every cell?
                return _raises_on_one_cell(fn), {}
            if " returned dtype " not in str(exc):
                return str(exc), {}
            faults[dt] = str(exc)
        except Exception:  # noqa: BLE001 - an index error on the example: not its fault
            return "", {}
    if len(faults) == 2:  # it changes the dtype whatever the scores': its fault everywhere
        return faults[torch.float32], {}
    return "", faults


def _raises_on_one_cell(fn) -> str:
    """Its error on one cell of index 0 ("" when none): a function that raises there raises
    on any tile (an index past a small table's end on the example tile does not count)."""
    from ..masks_mod import apply_score_mod

    one = torch.zeros((1, 1, 1, 1), dtype=torch.float32)
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.int64)
    try:
        with torch.no_grad():
            apply_score_mod(fn, one, zero, zero, zero, zero)
    except ValueError as exc:
        return str(exc) if " raised " in str(exc) else ""
    return ""


def _compile(gm) -> Program:
    prog = Program()
    reg: dict = {}
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != N_INPUTS:
        raise _Refuse(f"takes {len(inputs)} arguments, not 5")
    for i, n in enumerate(inputs):
        reg[n] = i

    def new() -> int:
        if prog.regs >= MAX_REGS:
            raise _Refuse(f"more than {MAX_REGS} values")
        prog.regs += 1
        return prog.regs - 1

    def emit(op, a=(), aux=-1) -> int:
        d = new()
        a = list(a) + [-1] * (4 - len(a))
        prog.code.append([OP[op], d, *a, aux])
        return d

    def table(t: torch.Tensor) -> int:
        for i, x in enumerate(prog.tables):
            if x is t:
                return i
        if t.dim() > 4 or t.is_complex() or t.device.type != "cpu":
            raise _Refuse(f"reads a tensor {tuple(t.shape)} on {t.device}")
        prog.tables.append(t)
        return len(prog.tables) - 1

    def value(x) -> int:
        if isinstance(x, torch.fx.Node):
            r = reg.get(x)
            if r is None:
                raise _Refuse(f"uses {x.op} {x.target}")
            if isinstance(r, torch.Tensor):  # a tensor read as a value: one element only
                if r.numel() != 1:
                    raise _Refuse(f"uses a tensor {tuple(r.shape)} other than by index")
                return emit("gather", (), table(r))
            return r
        if isinstance(x, bool | int | float):
            prog.consts.append(float(x))
            return emit("const", (), len(prog.consts) - 1)
        raise _Refuse(f"uses a {type(x).__name__} argument")

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            reg[n] = _attr(gm, n.target)
            continue
        if n.op == "output":
            prog.out = value(n.args[0])
            break
        target = n.target
        args = list(n.args)
        if n.kwargs:
            if set(n.kwargs) - {"alpha"}:
                raise _Refuse(f"{target} with {sorted(n.kwargs)}")
            if target in (torch.add, torch.sub, "add", "sub"):
                args[1] = _scaled(emit, value, args[1], n.kwargs["alpha"])
        if target in ("__getitem__", operator.getitem):
            base = reg.get(args[0])
            if not isinstance(base, torch.Tensor):
                raise _Refuse("indexes something other than a captured tensor")
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if len(idx) != base.dim():
                raise _Refuse(f"indexes a {base.dim()}-D tensor with {len(idx)} indices")
            reg[n] = emit("gather", [value(i) for i in idx], table(base))
        elif target in _BINARY:
            reg[n] = emit(_BINARY[target], [value(args[0]), value(args[1])])
        elif target in _UNARY:
            reg[n] = emit(_UNARY[target], [value(args[0])])
        elif target in (operator.pow, torch.pow, "pow"):
            e = args[1]
            if not isinstance(e, int | float):
                raise _Refuse("pow with an exponent that is not a constant")
            prog.consts.append(float(e))
            reg[n] = emit("pow", [value(args[0])], len(prog.consts) - 1)
        elif target in (torch.where, "where"):
            c, a, b = args if target is torch.where else (args[1], args[0], args[2])
            reg[n] = emit("where", [value(c), value(a), value(b)])
        elif target in (operator.truediv, torch.rsub):
            raise _Refuse(f"uses {target}")
        else:
            raise _Refuse(f"uses {getattr(target, '__name__', target)}")
    return prog


def _scaled(emit, value, x, alpha):
    return emit("mul", [value(x), value(alpha)])


def _attr(gm, name: str):
    obj = gm
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# ---- the program's meaning in torch (its check, and the tests' second opinion) ------------
def evaluate(prog: Program, s, b, h, q, kv):
    """The program on broadcastable torch tensors (score's dtype): its value."""
    dt = s.dtype
    r = [s, *(t.to(dt) for t in (b, h, q, kv))]
    r += [None] * (prog.regs - N_INPUTS)
    for op, d, a0, a1, a2, a3, aux in prog.code:
        name = OPS[op]
        x, y, z = (r[i] if i >= 0 else None for i in (a0, a1, a2))
        if name == "const":
            v = torch.tensor(prog.consts[aux], dtype=dt)
        elif name == "gather":
            t = prog.tables[aux].detach().to(dt)
            if t.dim() == 0:
                v = t
            else:
                ix = [r[i].round().long() for i in (a0, a1, a2, a3)[: t.dim()]]
                v = t[tuple(ix)]
        elif name == "where":
            v = torch.where(x != 0, y, z)
        else:
            v = _ELEMENTWISE[name](x, y, prog.consts[aux] if aux >= 0 else None)
        r[d] = v.to(dt)
    return torch.broadcast_to(r[prog.out], s.shape)


_ELEMENTWISE = {
    "add": lambda x, y, c: x + y,
    "sub": lambda x, y, c: x - y,
    "mul": lambda x, y, c: x * y,
    "div": lambda x, y, c: x / y,
    "neg": lambda x, y, c: -x,
    "tanh": lambda x, y, c: torch.tanh(x),
    "exp": lambda x, y, c: torch.exp(x),
    "log": lambda x, y, c: torch.log(x),
    "abs": lambda x, y, c: torch.abs(x),
    "sqrt": lambda x, y, c: torch.sqrt(x),
    "pow": lambda x, y, c: torch.pow(x, c),
    "sin": lambda x, y, c: torch.sin(x),
    "cos": lambda x, y, c: torch.cos(x),
    "lt": lambda x, y, c: (x < y).to(x.dtype),
    "le": lambda x, y, c: (x <= y).to(x.dtype),
    "gt": lambda x, y, c: (x > y).to(x.dtype),
    "ge": lambda x, y, c: (x >= y).to(x.dtype),
    "eq": lambda x, y, c: (x == y).to(x.dtype),
    "ne": lambda x, y, c: (x != y).to(x.dtype),
    "and": lambda x, y, c: ((x != 0) & (y != 0)).to(x.dtype),
    "or": lambda x, y, c: ((x != 0) | (y != 0)).to(x.dtype),
    "not": lambda x, y, c: (x == 0).to(x.dtype),
    "sigmoid": lambda x, y, c: torch.sigmoid(x),
    "max": lambda x, y, c: torch.maximum(x, y),
    "min": lambda x, y, c: torch.minimum(x, y),
    "floordiv": lambda x, y, c: torch.floor(x / y),
    "mod": lambda x, y, c: x - torch.floor(x / y) * y,
}


def _agrees(fn, prog: Program) -> bool:
    args = _example(torch.float64)
    try:
        with torch.no_grad():
            want = fn(*args)
            got = evaluate(prog, *args)
    except Exception:  # noqa: BLE001 - an example the function cannot take proves nothing
        return True
    return bool(torch.allclose(got, want.to(got.dtype), rtol=1e-5, atol=1e-6, equal_nan=True))
