"""The explorer in a real browser: Debian's Chromium, headless, driven by playwright.

No browser is ever downloaded: these tests use /usr/bin/chromium and are skipped, with
a loud message, only where it cannot run. Every request the page makes is recorded;
anything but the page's own file (or data:/blob:) fails the test.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import causalattn as ca
from causalattn import text, viz

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("CAUSALATTN_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "explorer.png"
LOCAL = ("file:", "data:", "blob:", "about:")


def _skip(reason: str):
    msg = f"\n!!! BROWSER TESTS SKIPPED: {reason}\n"
    print(msg, file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip("the playwright package is not installed (pip install 'causalattn[browser]')")
    if not Path(CHROMIUM).exists():
        _skip(f"{CHROMIUM} is missing (apt-get install -y chromium; `make browser`)")
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    except Exception as exc:  # noqa: BLE001 - any launch failure means "cannot run here"
        pw.stop()
        _skip(f"{CHROMIUM} cannot be launched headless here: {str(exc).splitlines()[0]}")
    yield b
    b.close()
    pw.stop()


class Page:
    """A page that records console errors, page errors, dialogs and non-local requests."""

    def __init__(self, browser, width=1500, height=1000):
        self.ctx = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: r.url.startswith(LOCAL) or self.requests.append(r.url))
        self.page.on("dialog", self._dialog)
        self.ctx.route("**/*", self._route)

    def _dialog(self, d):
        self.dialogs.append(d.message)
        d.dismiss()

    def _route(self, route):
        if route.request.url.startswith(LOCAL):
            route.continue_()
        else:
            self.requests.append(route.request.url)
            route.abort()

    def open(self, path: Path, timeout_ms: int = 30000) -> float:
        t0 = time.perf_counter()
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector(".ca-explorer[data-ready='1']", timeout=timeout_ms)
        return time.perf_counter() - t0

    def hover_row(self, panel: str, i: int, j: int = 0) -> None:
        """Move the mouse over cell (i, j) (0-based) of a panel's canvas."""
        over = self.page.locator(f"[data-panel={panel}] canvas.ca-over")
        over.scroll_into_view_if_needed()
        ml, mt, cell, _ = (float(x) for x in over.get_attribute("data-grid").split(","))
        box = over.bounding_box()
        self.page.mouse.move(box["x"] + ml + (j + 0.5) * cell, box["y"] + mt + (i + 0.5) * cell)

    def texts(self, selector: str) -> list[str]:
        return self.page.locator(selector).evaluate_all("els => els.map(e => e.textContent)")

    def side(self, col: str) -> list[str]:
        return self.texts(f"[data-role=side] td[data-col={col}]")

    def clean(self) -> None:
        assert self.errors == [], f"console errors: {self.errors}"
        assert self.requests == [], f"network requests: {self.requests}"
        assert self.dialogs == [], f"dialogs opened: {self.dialogs}"

    def close(self):
        self.ctx.close()


@pytest.fixture
def page(browser):
    p = Page(browser)
    yield p
    p.close()


def chapter_trace():
    X = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
    return ca.trace(X, np.eye(2), np.eye(2), np.array([[1, 1], [1, -1]], float),
                    tokens=["x1", "x2", "x3", "x4"])


def test_chapter_row_4_shows_the_chapter_weights(page, tmp_path):
    tr = chapter_trace()
    path = viz.write_explorer(tr, tmp_path / "chapter.html")
    page.open(path)
    page.hover_row("A", 1)  # row 2 first: one blocked key, weights from the trace itself
    assert page.side("weight") == [f"{a:.3f}" for a in tr.A[1][:2]] + ["0", "0"]
    page.hover_row("S", 3, 2)  # the chapter's last row, from another panel
    assert "query i = 4" in page.page.inner_text("[data-role=query-title]")
    assert page.side("weight") == ["0.065", "0.266", "0.131", "0.539"]  # the seed's numbers
    assert page.side("score") == ["-0.707", "0.707", "0.000", "1.414"]
    assert page.side("norm") == [f"{n:.3f}" for n in tr.explain(3).norm]
    assert "Σ_j A_ij = 1.0000 over 4 readable keys" in page.page.inner_text("[data-role=rowsum]")
    assert "[0.592, -1.279]" in page.page.inner_text("[data-role=side]")  # h_4
    page.clean()


def test_sentences_padding_heads_and_screenshot(page, tmp_path):
    batch = text.encode(text.SEED_SENTENCES)
    traces = viz.batch_traces(batch)
    path = viz.write_explorer(traces, tmp_path / "seed.html", names=viz.sentence_names(batch),
                              title="causalattn explorer: the seed's sentences")
    page.open(path)
    page.page.select_option("[data-role=seq]", index=3)  # sentence 4: 6 tokens, 4 padding
    summary = page.page.inner_text("[data-role=summary]")
    assert "T = 10 positions (6 tokens, 4 padding)" in summary
    assert page.texts("[data-role=tokens] .ca-tok") == batch.tokens[3]
    assert page.page.locator("[data-role=tokens] .ca-tok-pad").count() == 4
    # three mask styles: allowed, causally blocked, padding blocked are different colours
    colours = page.page.evaluate("""() => {
        const c = document.querySelector('[data-panel=M] canvas.ca-base');
        const [ml, mt, cell] = c.nextElementSibling.getAttribute('data-grid').split(',').map(Number);
        const px = (i, j) => Array.from(c.getContext('2d').getImageData(
            ml + (j + 0.5) * cell, mt + (i + 0.5) * cell, 1, 1).data).join(',');
        return [px(2, 1), px(1, 2), px(8, 8)];
    }""")
    assert len(set(colours)) == 3, colours
    page.hover_row("A", 7)  # a padding query: no readable key
    assert "Padding query" in page.page.inner_text("[data-role=side]")
    page.hover_row("A", 5)
    head1 = page.side("weight")
    want = [f"{a:.3f}" for a in traces[3].select(0).A[5][:6]] + ["0"] * 4
    assert head1 == want
    page.page.select_option("[data-role=head]", index=1)
    page.hover_row("A", 4)
    page.hover_row("A", 5)
    assert page.side("weight") == [f"{a:.3f}" for a in traces[3].select(1).A[5][:6]] + ["0"] * 4
    page.clean()
    DOCS_PNG.parent.mkdir(exist_ok=True)
    page.page.screenshot(path=str(DOCS_PNG), full_page=True)
    assert DOCS_PNG.stat().st_size > 10_000


HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<script>window.__pwned = 1</script>",
    "</script><script>window.__pwned = 2</script>",
    "<b onmouseover=\"window.__pwned = 3\">bold</b>",
    "&lt;&amp;\u2028<!--",
]


def _hostile_trace():
    rng = np.random.default_rng(1)
    T = len(HOSTILE)
    return ca.trace(rng.normal(size=(T, 4)), *(rng.normal(size=(4, 4)) for _ in range(3)),
                    tokens=HOSTILE)


@pytest.mark.parametrize("form", ["page", "notebook fragment"])
def test_hostile_tokens_are_text_and_no_script_runs(page, tmp_path, form):
    tr = _hostile_trace()
    path = tmp_path / "hostile.html"
    if form == "page":
        viz.write_explorer(tr, path, names=[HOSTILE[0]], title=HOSTILE[2])
    else:  # as Jupyter would insert it: no Content-Security-Policy to help
        path.write_text(f"<!DOCTYPE html><meta charset='utf-8'><body>{tr._repr_html_()}</body>",
                        encoding="utf-8")
    page.open(path)
    for i in range(len(HOSTILE)):
        page.hover_row("A", i, i)
    page.page.locator("[data-role=tokens] .ca-tok").nth(3).hover()
    assert page.texts("[data-role=tokens] .ca-tok") == HOSTILE
    assert page.side("token") == HOSTILE
    assert page.page.locator("img").count() == 0
    assert page.page.locator("b").count() == 0
    assert page.page.evaluate("() => window.__pwned === undefined")
    page.clean()


def test_2048_tokens_open_quickly(page, tmp_path):
    rng = np.random.default_rng(0)
    T, d = 2048, 16
    W = [rng.normal(size=(d, d)) / np.sqrt(d) for _ in range(3)]
    tr = ca.trace(rng.normal(size=(T, d)), *W, n_heads=2, tokens=[f"w{i}" for i in range(T)])
    path = viz.write_explorer(tr, tmp_path / "t2048.html")
    mib = path.stat().st_size / 2**20
    wall = page.open(path)
    in_page = float(page.page.get_attribute(".ca-explorer", "data-load-ms")) / 1000
    print(f"\n2048-token explorer ({mib:.1f} MiB, 2 heads): navigation to drawn {in_page:.2f} s "
          f"in the page, {wall:.2f} s wall clock", file=sys.stderr)
    page.page.fill("[data-role=query]", str(T))
    page.page.dispatch_event("[data-role=query]", "change")
    assert "query i = 2048" in page.page.inner_text("[data-role=query-title]")
    assert "Σ_j A_ij = 1.0000 over 2048 readable keys" in page.page.inner_text("[data-role=rowsum]")
    shown = page.side("weight")
    assert len(shown) == 64  # the 64 largest of 2048, not one element per key
    top = np.sort(tr.select(0).A[-1])[::-1][:64]
    assert sorted(float(w) for w in shown) == pytest.approx(sorted(top), abs=6e-4)
    page.clean()
    assert in_page < 10.0  # the 2 s goal is measured and reported, not asserted on a shared box
