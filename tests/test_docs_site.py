"""The documentation site: `mkdocs build --strict` into a scratch folder, then its pages.

The site is built here (skipped loudly where mkdocs is not installed: `pip install
'causalattn[docs]'`): an API page for every public module, a CLI page with every command,
no resource (script, style, font, icon, image, frame) from another host in any page or
stylesheet, and in Debian's Chromium (headless, driven by playwright, never downloaded;
skipped loudly where it cannot run) every page of the guides opens over a loopback HTTP
server with no failed request, no request off the machine and no script error.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
CHROMIUM = os.environ.get("CAUSALATTN_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
# a resource the page loads (not a link the reader may follow): tag attribute -> URL
RESOURCE = re.compile(
    r"<(?:script|img|iframe|source|video|audio|embed)\b[^>]*?\bsrc=[\"']([^\"']+)"
    r"|<link\b[^>]*?\bhref=[\"']([^\"']+)",
    re.I,
)
CSS_URL = re.compile(r"url\(\s*[\"']?(https?:)?//", re.I)


def _loud_skip(reason: str):
    print(f"\n!!! DOCS SITE TESTS SKIPPED: {reason}\n", file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError as exc:
        _loud_skip(f"{exc.name} is not installed (pip install 'causalattn[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_every_public_module_has_an_api_page(site):
    from docs_hooks import public_modules

    modules = public_modules()
    assert {"causalattn", "causalattn.masks", "causalattn.engines.tiled"} <= set(modules)
    import causalattn

    for name in causalattn._SUBMODULES:  # every submodule the package names is a page
        assert f"causalattn.{name}" in modules, name
    for name in modules:
        page = site / "reference" / "api" / f"{name}.html"
        assert page.is_file(), name
        assert 'class="doc doc-object doc-module"' in page.read_text(encoding="utf-8"), name
    text = (site / "reference" / "api" / "causalattn.html").read_text(encoding="utf-8")
    for name in causalattn.__all__:
        assert f"causalattn.{name}</code>" in text, name


def test_the_cli_page_has_every_command(site):
    from cli_reference import commands

    names = commands()
    assert "causalattn bench cpu" in names and "causalattn explore model" in names
    assert len(names) >= 15, names
    text = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    for name in names[1:]:
        assert f"<code>{name}</code>" in text, name
    assert "--max-bytes" in text and "--json" in text


def test_the_benchmarks_page_has_its_tables_and_plots(site):
    text = (site / "benchmarks.html").read_text(encoding="utf-8")
    assert "bench/cpu.png" in text and (site / "bench" / "cpu.png").stat().st_size > 1000
    assert "<table>" in text and "vs_sdpa" in text and "AMD EPYC" in text


def test_no_page_loads_anything_from_another_host(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 100
    for page in pages:
        for groups in RESOURCE.findall(page.read_text(encoding="utf-8")):
            url = next(g for g in groups if g)
            assert not re.match(r"(https?:)?//", url), f"{page.relative_to(site)}: {url}"
    for css in site.rglob("*.css"):
        assert not CSS_URL.search(css.read_text(encoding="utf-8")), css.relative_to(site)


def test_the_resource_check_sees_other_hosts():
    html = (
        '<link rel="stylesheet" href="https://fonts.example/x.css">'
        '<script src="//cdn.example/x.js"></script><img alt="" src="../patterns.png">'
        '<a href="https://example.org/">a link is no resource</a>'
    )
    urls = [next(g for g in groups if g) for groups in RESOURCE.findall(html)]
    assert urls == ["https://fonts.example/x.css", "//cdn.example/x.js", "../patterns.png"]
    assert CSS_URL.search("@font-face{src:url('https://fonts.example/a.woff2')}")
    assert not CSS_URL.search("a{background:url(../img/x.svg)}")


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the test reports what failed; not every request
        pass


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _loud_skip("the playwright package is not installed (pip install 'causalattn[browser]')")
    if not Path(CHROMIUM).exists():
        _loud_skip(f"{CHROMIUM} is missing (apt-get install -y chromium; `make browser`)")
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    except Exception as exc:  # noqa: BLE001 - any launch failure means "cannot run here"
        pw.stop()
        _loud_skip(f"{CHROMIUM} cannot be launched headless here: {str(exc).splitlines()[0]}")
    yield b
    b.close()
    pw.stop()


@pytest.mark.browser
def test_the_site_opens_in_chromium_with_no_failed_request(site, server, browser):
    pages = [p for p in sorted(site.rglob("*.html")) if "reference/api" not in p.as_posix()]
    pages += [site / "reference" / "api" / n for n in ("causalattn.html", "causalattn.masks.html")]
    ctx = browser.new_context()
    bad: list[str] = []
    errors: list[str] = []

    def route(r):
        if r.request.url.startswith((server, "data:", "blob:", "about:")):
            r.continue_()
        else:
            bad.append(f"off the machine: {r.request.url}")
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    page.on("requestfailed", lambda r: bad.append(f"failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and bad.append(f"{r.status}: {r.url}"))
    page.on("pageerror", lambda e: errors.append(str(e)))
    for path in pages:
        rel = path.relative_to(site).as_posix()
        page.goto(f"{server}/{rel}", wait_until="load", timeout=30000)
        page.wait_for_load_state("networkidle", timeout=30000)
        assert page.locator("h1").count() >= 1, rel
    # search runs in a worker from the local index; typed again while the worker starts
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = page.locator("input.md-search__input")
    for _ in range(9):
        box.click()
        box.fill("")
        page.keyboard.type("softmax", delay=20)
        try:
            page.wait_for_selector(".md-search-result__item", timeout=10000)
            break
        except PlaywrightTimeout:
            continue
    else:
        pytest.fail("the site's search found nothing for 'softmax' in 90 s")
    ctx.close()
    assert not bad, "\n".join(bad[:20])
    assert not errors, "\n".join(errors[:20])
