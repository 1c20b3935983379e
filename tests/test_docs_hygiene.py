"""The code and the docs describe what is: no issue numbers in them (git keeps the history,
and no user-visible string points at a tracker), and docs/design.md stays short enough to
read (at most 400 lines; the mutation log lives in docs/mutation.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
ISSUE = re.compile(r"\bissues? #?[0-9]", re.IGNORECASE)


def test_no_issue_number_in_src_or_docs():
    hits = []
    for folder in ("src", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix in (".png", ".svg", ".so", ".pyc"):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for n, line in enumerate(text.splitlines(), 1):
                if ISSUE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


def test_design_md_stays_within_400_lines_and_the_mutation_log_lives_apart():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert len(design.splitlines()) <= 400
    assert "(mutation.md)" in design  # linked, not copied
    assert "survived" in (ROOT / "docs" / "mutation.md").read_text(encoding="utf-8")
