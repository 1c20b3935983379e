"""Jobs for the runner's fresh workers: module level (they pickle by reference) and in a
module that imports little, so a fresh worker loads them quickly."""

from __future__ import annotations

import os
import sys


def facts():
    """What a fresh worker says about itself."""
    import causalattn
    from causalattn.io import runner

    return {
        "remaining": runner.remaining(),
        "session_leader": os.getsid(0) == os.getpid(),
        "fresh": sys.argv == ["-c"],  # a new interpreter's command line, not a fork of pytest
        "causalattn": causalattn.__file__,
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }


def say_and_exit(code: int):
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os._exit(code)
