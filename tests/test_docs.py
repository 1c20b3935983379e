"""Every Python and shell block of README.md and docs/**/*.md runs, as it is.

Blocks run from a scratch copy of the repository root (``examples/`` copied, ``.venv``
linked to this interpreter's environment) with a timeout, with ``causalattn`` and
``torchrun`` on PATH as after ``make`` and activating the venv. A page's Python blocks run
in one subprocess, each in a fresh namespace (one start of torch per page, not per
block); the failing block is named by its line. Markers in an HTML comment on the line
before a block:

    <!-- no-run: reason -->   not run here (say why; use sparingly)
    <!-- needs: cuda -->      skipped without a CUDA device
    <!-- torchrun: P -->      saved as ring.py and run with torchrun on P processes
    <!-- continues -->        a Python block that continues the previous Python block

``console`` blocks are transcripts (commands with their output), not scripts; blocks with
no language or ``text`` are not code. A shell line may exit 0, or 1 where the command
documents 1 as "found a fault" (audit, diagnose); it must never print a traceback or an
``error:`` line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
CODE = ("python", "bash", "sh", "shell")
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


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)} line {line}"


def page_blocks(page: Path) -> list[dict]:
    """The page's code blocks, ``continues`` joined to the block before, ``where`` set."""
    out, previous = [], ""
    for b in readme_blocks(page.read_text(encoding="utf-8")):
        if b["lang"] not in CODE:
            continue
        b["where"] = _where(page, b["line"])
        if "no-run" in b["marks"]:
            assert b["marks"]["no-run"], f"{b['where']}: <!-- no-run: --> needs a reason"
        if b["lang"] == "python":
            b["code"] = (previous if "continues" in b["marks"] else "") + b["code"]
            previous = b["code"]
        out.append(b)
    return out


def _runnable() -> list:
    """One case per page's Python blocks (run together), one per shell or torchrun block."""
    params = []
    for page in PAGES:
        blocks = page_blocks(page)
        name = str(page.relative_to(ROOT))
        plain = [b for b in blocks if b["lang"] == "python" and not set(b["marks"]) - {"continues"}]
        if plain:
            params.append(pytest.param("python", plain, id=f"{name}-python"))
        for b in blocks:
            if b in plain:
                continue
            marks = []
            if "no-run" in b["marks"]:
                marks.append(pytest.mark.skip(reason=f"{b['where']}: {b['marks']['no-run']}"))
            kind = "torchrun" if "torchrun" in b["marks"] else b["lang"]
            params.append(pytest.param(kind, [b], id=f"{name}-{kind}-line{b['line']}", marks=marks))
    return params


# runs a page's Python blocks, each in a fresh namespace; reports the first that fails
_DRIVER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
for b in blocks:
    try:
        exec(compile(b["code"], b["where"], "exec"), {"__name__": "__main__"})
    except BaseException:
        print("\\nFAILED " + b["where"] + "\\n" + traceback.format_exc(), file=sys.stderr)
        sys.exit(1)
"""


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
@pytest.mark.parametrize(("kind", "blocks"), _runnable())
def test_docs_blocks_run(kind, blocks, scratch, request):
    where = blocks[0]["where"]
    marks = blocks[0]["marks"]
    if marks.get("needs") == "cuda" and not _cuda():
        pytest.skip(f"{where}: needs a CUDA device")
    env = _env()
    if kind == "torchrun":
        from causalattn.distributed.demo import free_port

        request.getfixturevalue("loopback_ports")  # free_port() then bind (tests/conftest.py)
        nproc = int(marks["torchrun"] or 2)
        (scratch / "ring.py").write_text(blocks[0]["code"])
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
    elif kind == "python":
        (scratch / "_blocks.json").write_text(json.dumps(blocks))
        res = subprocess.run(
            [sys.executable, "-c", _DRIVER, "_blocks.json"],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        _check(res, ", ".join(b["where"] for b in blocks))
    else:  # one subprocess per command line, in order, sharing the scratch folder
        for line in blocks[0]["code"].splitlines():
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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_markers_are_known_and_sparing(page):
    blocks = readme_blocks(page.read_text(encoding="utf-8"))
    known = {"no-run", "needs", "torchrun", "continues"}
    for b in blocks:
        assert set(b["marks"]) <= known, (page.name, b["line"], b["marks"])
    code = [b for b in blocks if b["lang"] in CODE]
    skipped = [b for b in code if "no-run" in b["marks"]]
    assert len(skipped) <= max(2, len(code) // 4), [b["line"] for b in skipped]


def test_the_docs_have_code_to_run():
    blocks = [b for page in PAGES for b in page_blocks(page)]
    assert len(blocks) >= 25, len(blocks)
    assert sum("no-run" in b["marks"] for b in blocks) <= len(blocks) // 6


def test_readme_is_two_screens_with_the_two_commands_first():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, len(lines)
    head = "\n".join(lines[:40])
    assert "make demo" in head and "make test" in head
