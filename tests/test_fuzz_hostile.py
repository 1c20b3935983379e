"""Runs tests/fuzz_hostile.py (hypothesis over the CLI's arguments and over attention,
trace and encode inputs) in one subprocess with address space and CPU time capped, so a
blow-up fails this test instead of the machine."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
GiB = 2**30


@pytest.mark.slow
def test_fuzz_clean_error_or_correct_result(tmp_path):
    def limits():
        resource.setrlimit(resource.RLIMIT_AS, (4 * GiB, 4 * GiB))
        resource.setrlimit(resource.RLIMIT_CPU, (600, 600))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HERE.parent / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    res = subprocess.run(
        [sys.executable, str(HERE / "fuzz_hostile.py"), str(tmp_path), "80"],
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=limits,
        env=env,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-8000:]
    for name in ("fuzz_cli", "fuzz_attention", "fuzz_trace", "fuzz_encode"):
        assert f"ok {name}" in res.stdout, res.stdout
