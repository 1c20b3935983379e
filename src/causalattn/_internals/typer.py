"""typer's click: the exceptions its commands raise, and its ``echo``.

Why no public API serves: typer (0.2x) vendors click as ``typer._click`` and no longer
depends on click; of click's exceptions it re-exports only ``BadParameter``. The CLI's
one-line errors (``cli._OneLineErrors``) must catch ``UsageError``, ``NoArgsIsHelpError``
and ``ClickException`` exactly as typer raises them, so they come from where typer raises
them. A typer old enough to use click itself raises click's own (the fallback).
tests/test_internals.py fails when typer moves them.
"""

from __future__ import annotations

try:
    from typer import _click as click
except ImportError:  # a typer that still uses the click package
    import click

__all__ = ["click"]
