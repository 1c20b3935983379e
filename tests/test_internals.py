"""The other libraries' private names that causalattn keeps (src/causalattn/_internals/):
each test fails when its library changes the name, so the change is seen here first."""

from __future__ import annotations

import ast
import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from causalattn._internals.typer import click


def _app():
    app = typer.Typer(no_args_is_help=True, add_completion=False)

    @app.command()
    def one(n: int):
        raise click.exceptions.ClickException(f"got {n}")

    @app.command()
    def two():
        pass

    return typer.main.get_command(app)


def test_typer_raises_the_click_exceptions_the_cli_catches():
    cmd = _app()
    with pytest.raises(click.exceptions.NoArgsIsHelpError):
        cmd.main([], standalone_mode=False)
    with pytest.raises(click.exceptions.UsageError):
        cmd.main(["one", "--nope"], standalone_mode=False)
    with pytest.raises(click.exceptions.UsageError):  # typer's own BadParameter is one
        cmd.main(["one", "x"], standalone_mode=False)
    with pytest.raises(click.exceptions.ClickException, match="got 3"):
        cmd.main(["one", "3"], standalone_mode=False)
    assert issubclass(typer.BadParameter, click.exceptions.UsageError)
    assert click.echo is typer.echo


def test_the_cli_turns_them_into_one_error_line():
    from causalattn.cli import app

    r = CliRunner().invoke(app, ["masks", "--no-such-flag"])
    assert r.exit_code == 2
    assert r.output.splitlines()[0].startswith("error: "), r.output


def test_internals_import_only_their_own_library():
    import causalattn._internals as pkg

    allowed = {"typer.py": {"__future__", "typer", "click"}, "transformers.py": {"__future__"}}
    allowed["torch.py"] = {"__future__", "torch"}
    allowed["triton.py"] = {"__future__", "contextlib", "threading", "numpy", "triton"}
    allowed["__init__.py"] = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {m.split(".")[0] for m in names} <= allowed[path.name], (path.name, names)


def test_the_attention_implementation_reads_what_set_attn_implementation_set():
    pytest.importorskip("transformers")
    import _hf_tiny as tiny

    from causalattn._internals.transformers import attn_implementation

    model = tiny.model("llama", impl="eager")
    assert attn_implementation(model) == "eager"
    model.set_attn_implementation("sdpa")
    assert attn_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    assert attn_implementation(model) == "eager"


# ---- torch ---------------------------------------------------------------------------------


@torch.library.custom_op("causalattn_internals_test::grad_inside", mutates_args=())
def _grad_inside(x: torch.Tensor, guard: bool) -> torch.Tensor:
    """d sum(x²)/dx computed by autograd inside an operator (NaN when autograd records
    nothing there)."""
    from causalattn._internals.torch import autograd_inside

    with autograd_inside() if guard else contextlib.nullcontext(), torch.enable_grad():
        leaf = x.detach().requires_grad_(True)
        y = leaf.square().sum()
        if not y.requires_grad:
            return torch.full_like(x, float("nan"))
        (g,) = torch.autograd.grad(y, leaf)
    return g


def test_autograd_records_inside_an_operator_only_under_the_guard():
    """An operator's implementation runs without the Autograd keys (enable_grad alone
    records nothing: the day that changes, the guard can go); the guard puts them back."""
    x = torch.arange(4.0)
    for outer in (contextlib.nullcontext(), torch.no_grad()):
        with outer:
            assert torch.isnan(_grad_inside(x, False)).all()
            torch.testing.assert_close(_grad_inside(x, True), 2 * x)
    assert torch.is_grad_enabled()


def test_constant_result_marks_as_dynamo_does_and_import_leaves_dynamo_out():
    """constant_result sets exactly what torch.compiler.assume_constant_result sets (so
    compiling sees the same constants), and `import causalattn.cli` no longer imports
    torch._dynamo (half of every CLI start-up)."""
    from causalattn._internals.torch import constant_result

    def ours():
        return 1

    def torchs():
        return 1

    assert constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}
    code = "import sys, causalattn.cli; print('torch._dynamo' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr


def test_transforms_active_inside_torch_func_only_where_the_tensors_look_plain():
    from causalattn._internals.torch import transforms_active

    seen = []

    def f(x):
        seen.append((transforms_active(), type(x) is torch.Tensor))
        return x.square().sum()

    f(torch.ones(3))
    torch.func.grad(f)(torch.ones(3))
    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == [(False, True), (True, True), (True, True)]
    assert not transforms_active()


def test_is_fake_tells_a_fake_tensor_where_is_compiling_does_not():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from causalattn._internals.torch import is_fake

    with FakeTensorMode():
        fake = torch.empty(2, 3)
        assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    assert is_fake(fake) and fake.device.type == "cpu" and fake.shape == (2, 3)
    assert not is_fake(torch.empty(2, 3)) and not is_fake(torch.empty(2, device="meta"))


def test_version_grows_with_in_place_writes_and_only_with_them():
    from causalattn._internals.torch import version

    t = torch.zeros(2, 3)
    v0 = version(t)
    assert isinstance(v0, int)
    t.sum(), t.clone().add_(1), t[0] + 1  # reads and writes elsewhere
    assert version(t) == v0
    t.add_(1)
    v1 = version(t)
    assert v1 > v0
    t[0].mul_(2)  # through a view
    assert version(t) > v1


# ---- triton's interpreter ----------------------------------------------------------------


def _dot_kernel():
    """A 16x16 tl.dot with a loop whose bound is a loaded scalar, jitted for the interpreter
    (triton.knobs.runtime.interpret must be set when it is made)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(A, B, O, N):
        r = tl.arange(0, 16)
        a = tl.load(A + r[:, None] * 16 + r[None, :])
        b = tl.load(B + r[:, None] * 16 + r[None, :])
        acc = tl.dot(a, b)
        for _ in range(0, tl.load(N)):
            acc += 1.0
        tl.store(O + r[:, None] * 16 + r[None, :], acc)

    return dot


def test_the_interpreter_fixes_are_held_only_inside_the_block(monkeypatch):
    """Inside: a bf16 tl.dot right and a loaded scalar as a range bound; outside, triton's
    own functions (and its bf16 dot still wrong: the day triton fixes it, the fix can go)."""
    triton = pytest.importorskip("triton")
    from triton.runtime import interpreter as it

    from causalattn._internals.triton import interpreter_fixes

    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    kernel = _dot_kernel()
    own = (it._patch_lang_tensor, it.InterpreterBuilder.create_dot)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    want = a.float() @ b.float() + 3
    n = torch.tensor([3], dtype=torch.int32)

    def run():
        out = torch.empty(16, 16)
        kernel[(1,)](a, b, out, n)
        return out

    with interpreter_fixes():
        with interpreter_fixes():  # nested: held until the outermost block ends
            pass
        assert (it._patch_lang_tensor, it.InterpreterBuilder.create_dot) != own
        torch.testing.assert_close(run(), want, rtol=1e-5, atol=1e-4)
    assert (it._patch_lang_tensor, it.InterpreterBuilder.create_dot) == own
    assert (run() - want).abs().max() > 1.0  # triton's own bf16 dot: the raw bits
