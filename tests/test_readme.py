"""Every Python and shell block of the README runs, as it is (issue 16).

Blocks run from a scratch copy of the repository root (``examples/`` copied, ``.venv``
linked to this interpreter's environment), each in its own subprocess with a timeout,
with ``causalattn`` and ``torchrun`` on PATH as after ``make`` and activating the venv.
Markers in an HTML comment on the line before a block:

    <!-- no-run: reason -->   not run here (say why; use sparingly)
    <!-- needs: cuda -->      skipped without a CUDA device
    <!-- torchrun: P -->      saved as ring.py and run with torchrun on P processes
    <!-- continues -->        a Python block that continues the previous Python block

``console`` blocks are transcripts (commands with their output), not scripts. A shell
line may exit 0, or 1 where the command documents 1 as "found a fault" (audit,
diagnose); it must never print a traceback or an ``error:`` line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
TIMEOUT = 600

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")


def readme_blocks(text: str) -> list[dict]:
    """[{lang, code, line, marks}] for every fenced block, marks from the comment lines above."""
    lines = text.splitlines()
    blocks, k = [], 0
    while k < len(lines):
        m = _FENCE.match(lines[k])
        if not m:
            k += 1
            continue
        marks, j = {}, k - 1
        while j >= 0 and _MARK.match(lines[j]):
            name, arg = _MARK.match(lines[j]).groups()
            marks[name] = arg or ""
            j -= 1
        end = next(e for e in range(k + 1, len(lines)) if lines[e].startswith("```"))
        blocks.append(
            {
                "lang": m.group(1),
                "code": "\n".join(lines[k + 1 : end]) + "\n",
                "line": k + 1,
                "marks": marks,
            }
        )
        k = end + 1
    return blocks


def _runnable() -> list:
    params, previous = [], ""
    for b in readme_blocks(README.read_text(encoding="utf-8")):
        if b["lang"] not in ("python", "bash", "sh", "shell"):
            continue
        if b["lang"] == "python":
            b["code"] = (previous if "continues" in b["marks"] else "") + b["code"]
            previous = b["code"]
        marks = []
        if "no-run" in b["marks"]:
            reason = b["marks"]["no-run"]
            assert reason, f"README line {b['line']}: <!-- no-run: --> needs a reason"
            marks.append(pytest.mark.skip(reason=f"README: {reason}"))
        params.append(pytest.param(b, id=f"{b['lang']}-line{b['line']}", marks=marks))
    return params


@pytest.fixture
def scratch(tmp_path) -> Path:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return tmp_path


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    env.pop("CAUSALATTN_DEBUG", None)
    return env


def _check(res: subprocess.CompletedProcess, what: str, ok=(0,)) -> None:
    out = res.stdout + res.stderr
    assert res.returncode in ok, f"{what}: exit {res.returncode}\n{out[-4000:]}"
    assert "Traceback" not in out, f"{what}:\n{out[-4000:]}"
    assert not re.search(r"^error: ", res.stderr, re.M), f"{what}:\n{res.stderr[-4000:]}"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable())
def test_readme_block_runs(block, scratch, request):
    where = f"README.md line {block['line']}"
    if "needs" in block["marks"] and block["marks"]["needs"] == "cuda" and not _cuda():
        pytest.skip(f"{where}: needs a CUDA device")
    env = _env()
    if block["lang"] == "python" and "torchrun" in block["marks"]:
        from causalattn.distributed.demo import free_port

        request.getfixturevalue("loopback_ports")  # free_port() then bind (tests/conftest.py)
        nproc = int(block["marks"]["torchrun"] or 2)
        (scratch / "ring.py").write_text(block["code"])
        cmd = [
            str(VENV_BIN / "torchrun"),
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "ring.py",
        ]
        res = subprocess.run(
            cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT
        )
        _check(res, where)
    elif block["lang"] == "python":
        res = subprocess.run(
            [sys.executable, "-c", block["code"]],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        _check(res, where)
    else:  # one subprocess per command line, in order, sharing the scratch folder
        for line in block["code"].splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            res = subprocess.run(
                ["bash", "-c", line],
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            finds_faults = re.search(r"causalattn (audit|diagnose)\b", line)
            _check(res, f"{where}: {line.strip()}", ok=(0, 1) if finds_faults else (0,))


def test_readme_markers_are_known_and_sparing():
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    known = {"no-run", "needs", "torchrun", "continues"}
    for b in blocks:
        assert set(b["marks"]) <= known, (b["line"], b["marks"])
    code = [b for b in blocks if b["lang"] in ("python", "bash", "sh", "shell")]
    skipped = [b for b in code if "no-run" in b["marks"]]
    assert len(code) >= 8 and len(skipped) <= max(2, len(code) // 4), [b["line"] for b in skipped]
