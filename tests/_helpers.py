"""What several test modules share (tests never import from benchmarks/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_in_triton_interpreter(test_file: str, timeout: float = 600) -> str:
    """Run a test module under TRITON_INTERPRET=1 in a subprocess (the variable must be set
    before triton is first imported); fail with its output's tail; return the summary line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(test_file)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(here),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(here.parent.parent),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"{here.name} failed in Triton's interpreter:\n{tail}"
    assert " passed" in tail, tail
    return tail.strip().splitlines()[-1]
