"""mkdocs hooks for `make docs`: the pages generated from the code, nothing from the network.

- API reference: one page per public module (every module of ``causalattn`` with no
  ``_``-prefixed part, the ``cli`` package's command modules aside: the CLI page has
  them), each a mkdocstrings ``:::`` of the module, listed under Reference in the nav.
- CLI reference: ``reference/cli.md`` from the typer app (tools/cli_reference.py).
- Benchmarks: the tables and plots replace ``<!-- bench-tables -->`` in benchmarks.md
  (tools/bench_page.py, from docs/bench/*.json).
"""

from __future__ import annotations

import inspect
import pkgutil
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:0] = [str(TOOLS), str(ROOT / "src")]

import bench_page  # noqa: E402
import cli_reference  # noqa: E402

_IMAGES: dict[str, bytes] = {}


def public_modules() -> list[str]:
    """Every public module's dotted name, the package first, then in path order."""
    import causalattn

    names = ["causalattn"]
    for info in pkgutil.walk_packages(causalattn.__path__, "causalattn."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]) or parts[1] == "cli":
            continue
        names.append(info.name)
    return names


def api_path(module: str) -> str:
    return f"reference/api/{module}.md"


def on_config(config):
    # the API pages under Reference, grouped by subpackage
    groups: dict[str, list] = {}
    for name in public_modules():
        key = ".".join(name.split(".")[:2])
        groups.setdefault(key, []).append({name: api_path(name)})
    api = [g[0] if len(g) == 1 else {k: g} for k, g in groups.items()]
    for section in config["nav"]:
        if isinstance(section, dict) and "Reference" in section:
            section["Reference"].append({"API": api})
    return config


def _package_page() -> str:
    """The package's page: its docstring, then each name of ``__all__`` linked to where
    it is defined (the names load lazily, so the page lists them rather than inline them)."""
    import causalattn

    rows = ["| name | defined in |", "|---|---|"]
    here = []  # public names of private modules (Trace): documented on this page
    for name in causalattn.__all__:
        obj = getattr(causalattn, name)
        module = obj.__name__ if inspect.ismodule(obj) else obj.__module__
        if any(part.startswith("_") for part in module.split(".")[1:]):
            rows.append(f"| `causalattn.{name}` | [below](#{module}.{name}) |")
            here.append(f"::: {module}.{name}\n    options:\n      heading_level: 2\n")
            continue
        anchor = "" if inspect.ismodule(obj) else f"#{module}.{name}"
        rows.append(f"| `causalattn.{name}` | [`{module}`]({module}.md{anchor}) |")
    return (
        "::: causalattn\n    options:\n      members: false\n      heading_level: 1\n\n"
        "## Public names (`causalattn.__all__`)\n\n" + "\n".join(rows) + "\n\n" + "\n".join(here)
    )


def on_files(files, config):
    for name in public_modules():
        module_page = f"::: {name}\n    options:\n      heading_level: 1\n"
        text = _package_page() if name == "causalattn" else module_page
        files.append(File.generated(config, api_path(name), content=text))
    files.append(File.generated(config, "reference/cli.md", content=cli_reference.page()))
    _IMAGES.clear()
    tables, images = bench_page.page()
    _IMAGES["tables"] = tables.encode()
    for path, data in images.items():
        files.append(File.generated(config, path, content=data))
    return files


# the docstrings' Sphinx roles (:mod:`x`, :class:`~x.Y`), rendered as plain code
_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):(<code>)~?")


def on_page_content(html, page, config, files):
    return _ROLE.sub(r"\1", html)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "benchmarks.md":
        return markdown.replace("<!-- bench-tables -->", _IMAGES["tables"].decode())
    return markdown
