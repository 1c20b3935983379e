"""Start-up without torch: `causalattn --help`, `shapes`, `masks "..."` and
`learn --json` import no torch, and print what they print with torch loaded; `import
causalattn` is lazy (PEP 562) and keeps every public name."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import causalattn
from causalattn.bench import startup
from causalattn.cli import app

SRC = str(Path(__file__).resolve().parents[2] / "src")

# As the console script runs: main() with sys.argv; at exit (after SystemExit too) the child
# says on stderr whether torch (or any torch.* module) was imported.
_CHILD = r"""
import sys
sys.argv = ["causalattn", *{args!r}]
from causalattn.cli import main
try:
    main()
finally:
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print("TORCH-MODULES " + " ".join(loaded[:5]), file=sys.stderr)
"""


def _child(args: list[str], code: str = _CHILD) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code.format(args=args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", "COLUMNS": "80", "TERM": "dumb"},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("args", [list(a) for a in startup.COMMANDS.values()], ids=str)
def test_the_startup_commands_import_no_torch_and_print_as_with_torch(args):
    res = _child(args)
    assert res.returncode == 0, res.stderr
    marker = res.stderr.strip().splitlines()[-1]
    assert marker == "TORCH-MODULES", marker  # nothing after it: no torch module at all
    # the same output as in this process, where torch is loaded (as every command did before)
    import torch  # noqa: F401

    assert "torch" in sys.modules
    env = {"COLUMNS": "80", "TERM": "dumb"}
    here = CliRunner().invoke(app, args, env=env, prog_name="causalattn")
    assert here.exit_code == 0, here.output
    assert res.stdout == here.stdout
    if args == ["learn", "--json"]:
        want = json.loads(json.dumps(causalattn.learn.questions()))
        assert json.loads(res.stdout)["questions"] == want


def test_the_check_catches_a_command_that_imports_torch():
    """The marker is no test that cannot fail: a command that needs torch shows it."""
    res = _child(["bench", "cpu", "--help"])
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines()[-1] == "TORCH-MODULES"  # --help alone: still none
    code = _CHILD.replace(
        "from causalattn.cli import main",
        "import causalattn.engines\n" + "from causalattn.cli import main",
    )
    res = _child(["shapes"], code)
    assert res.stderr.strip().splitlines()[-1].startswith("TORCH-MODULES torch")


def test_a_command_loads_only_its_own_module():
    """Each command's module is loaded when it runs; `--help` loads them all."""
    code = _CHILD.replace(
        '    print("TORCH-MODULES',
        '    cli = sorted(m[15:] for m in sys.modules if m.startswith("causalattn.cli."))\n'
        '    print("CLI " + " ".join(n for n in cli if not n.startswith("_")), file=sys.stderr)\n'
        '    print("TORCH-MODULES',
    )
    res = _child(["shapes", "--json"], code)
    assert res.returncode == 0, res.stderr
    assert "CLI shapes" in res.stderr.splitlines(), res.stderr
    res = _child(["--help"], code)
    from causalattn.cli import COMMANDS

    want = "CLI " + " ".join(sorted(COMMANDS.values()))
    assert want in res.stderr.splitlines(), res.stderr


def test_import_causalattn_is_lazy_and_keeps_every_public_name():
    code = (
        "import sys, causalattn; assert 'torch' not in sys.modules, 'import'; "
        "names = dir(causalattn); assert 'torch' not in sys.modules, 'dir'; "
        "assert set(causalattn.__all__) <= set(names), names; "
        "from causalattn import *; assert 'torch' in sys.modules; print('ok')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    from causalattn import check, engines, layer, matrix_form, shapes, text, trace

    want = {
        "trace": matrix_form.trace,
        "attention": engines.attention,
        "KVCache": engines.KVCache,
        "audit": check.audit,
        "diagnose": check.diagnose,
        "Report": check.Report,
        "Diagnosis": check.Diagnosis,
        "AuditInputError": check.AuditInputError,
        "encode": text.encode,
        "Vocabulary": text.Vocabulary,
        "Batch": text.Batch,
        "shape_table": shapes.shape_table,
        "CausalSelfAttention": layer.CausalSelfAttention,
    }
    for name, obj in want.items():
        assert getattr(causalattn, name) is obj, name
    assert trace is matrix_form.trace  # `from causalattn import trace`: the function, as before
    for name in ("masks", "text", "shapes", "viz", "distributed", "learn", "check", "engines"):
        assert getattr(causalattn, name).__name__ == f"causalattn.{name}"
    importlib.import_module("causalattn._trace")  # Trace's module loaded: trace stays the function
    assert causalattn.trace is matrix_form.trace
    assert causalattn.Trace is sys.modules["causalattn._trace"].Trace
    assert {"trace", "Trace", "masks", "learn", "distributed"} <= set(dir(causalattn))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        causalattn.nope  # noqa: B018


def test_python_dash_m_causalattn_is_the_command():
    for mod in ("causalattn", "causalattn.cli"):
        res = subprocess.run(
            [sys.executable, "-m", mod, "shapes", "-T", "4", "--d-model", "8", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PYTHONPATH": SRC},
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["seq_len"] == 4


def test_bench_io_startup_rows_time_each_command_against_import_torch():
    rows = startup.run(reps=1)
    assert [r["case"] for r in rows] == [startup.PEER, *startup.COMMANDS]
    peer = rows[0]["wall_s"]
    assert peer > 0 and "ratio" not in rows[0]
    for r in rows[1:]:
        assert r["reps"] == 1 and r["wall_min_s"] == r["wall_s"] == r["wall_max_s"] > 0
        assert r["ratio"] == pytest.approx(r["wall_s"] / peer)
        assert r["meets_bar"] == (r["ratio"] <= startup.BAR)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        startup.run(reps=0)
