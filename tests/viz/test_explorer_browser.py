"""The explorer in a real browser: Debian's Chromium, headless, driven by playwright.

No browser is ever downloaded: these tests use /usr/bin/chromium and are skipped, with
a loud message, only where it cannot run. Every request the page makes is recorded;
anything but the page's own file (or data:/blob:) fails the test.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

import _helpers
import numpy as np
import pytest

import causalattn as ca
from causalattn import masks, text, viz

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("CAUSALATTN_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DOCS_PNG = Path(__file__).resolve().parents[2] / "docs" / "explorer.png"
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
    return ca.trace(
        X, np.eye(2), np.eye(2), np.array([[1, 1], [1, -1]], float), tokens=["x1", "x2", "x3", "x4"]
    )


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
    path = viz.write_explorer(
        traces,
        tmp_path / "seed.html",
        names=viz.sentence_names(batch),
        title="causalattn explorer: the seed's sentences",
    )
    page.open(path)
    page.page.select_option("[data-role=seq]", index=3)  # sentence 4: 6 tokens, 4 padding
    summary = page.page.inner_text("[data-role=summary]")
    assert "T = 10 positions (6 tokens, 4 padding)" in summary
    assert page.texts("[data-role=tokens] .ca-tok") == batch.tokens[3]
    assert page.page.locator("[data-role=tokens] .ca-tok-pad").count() == 4
    # three mask styles: allowed, causally blocked, padding blocked are different colours
    colours = page.page.evaluate("""() => {
        const c = document.querySelector('[data-panel=M] canvas.ca-base');
        const [ml, mt, cell] = c.nextElementSibling.getAttribute('data-grid')
            .split(',').map(Number);
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


def window_traces():
    """The seed's sentences under a sliding window of 3 with their padding: one Pattern each."""
    batch = text.encode(text.SEED_SENTENCES)
    rng = np.random.default_rng(0)
    E = rng.normal(size=(len(batch.vocab), 8))
    W = [rng.normal(size=(8, 8)) / np.sqrt(8) for _ in range(3)]
    out = []
    for b in range(batch.B):
        out.append(
            ca.trace(
                E[batch.ids[b]][None],
                *W,
                window=3,
                lengths=batch.lengths[b : b + 1],
                n_heads=2,
                tokens=batch.tokens[b],
            )
        )
    return batch, out


def test_window_and_padding_in_one_view_each_kind_named(page, tmp_path):
    batch, tr = window_traces()
    path = viz.write_explorer(
        tr,
        tmp_path / "window.html",
        names=viz.sentence_names(batch),
        title="causalattn explorer: window 3 + padding",
    )
    page.open(path)
    page.page.select_option("[data-role=seq]", index=3)  # 6 tokens, 4 padding
    legend = page.texts("[data-role=legend] .ca-legend-item")
    assert legend == [
        viz.KINDS[c].label for c in (masks.READABLE, masks.PADDING, masks.FUTURE, masks.WINDOW)
    ]
    colours = page.page.evaluate("""() => {
        const c = document.querySelector('[data-panel=M] canvas.ca-base');
        const [ml, mt, cell] = c.nextElementSibling.getAttribute('data-grid')
            .split(',').map(Number);
        const px = (i, j) => Array.from(c.getContext('2d').getImageData(
            ml + (j + 0.5) * cell, mt + (i + 0.5) * cell, 1, 1).data).join(',');
        return [px(4, 3), px(4, 0), px(1, 3), px(8, 8)];  // readable, window, future, padding
    }""")
    assert len(set(colours)) == 4, colours
    page.hover_row("A", 4, 0)
    assert "blocked: outside the window" in page.page.inner_text("[data-role=cell]")
    kinds = page.page.locator("[data-role=side] tr[data-kind]").evaluate_all(
        "rs => rs.map(r => r.getAttribute('data-kind'))"
    )
    assert kinds == ["window", "window", "future"] + ["padding"] * 4  # row 5: keys 3-5 readable
    page.clean()
    DOCS_PNG.parent.mkdir(exist_ok=True)
    page.page.screenshot(path=str(DOCS_PNG), full_page=True)
    assert DOCS_PNG.stat().st_size > 10_000


def test_score_modifiers_are_applied_by_the_page_itself(page, tmp_path):
    """softcap, ALiBi and sinks (Gemma 2, BLOOM, gpt-oss) with a window: the page recomputes
    A from Q and K with them, and shows the trace's own weights."""
    rng = np.random.default_rng(3)
    T = 12
    W = [rng.normal(size=(8, 8)) for _ in range(3)]
    tr = ca.trace(
        rng.normal(size=(1, T, 8)),
        *W,
        n_heads=2,
        window=5,
        softcap=3.0,
        alibi_slopes=np.array([0.5, 0.25]),
        sinks=np.array([0.3, 2.0]),
        tokens=[f"t{i}" for i in range(T)],
    )
    page.open(viz.write_explorer(tr, tmp_path / "mods.html"))
    for h in (0, 1):
        page.page.select_option("[data-role=head]", index=h)
        page.hover_row("A", 10)
        page.hover_row("A", 11)
        want = tr.A[0, h, 11]
        assert [float(w) for w in page.side("weight")] == pytest.approx(want, abs=6e-4)
        total = page.page.inner_text("[data-role=rowsum]")
        assert f"Σ_j A_ij = {want.sum():.4f} over 5 readable keys" in total  # the sink's share
    page.clean()


def test_many_sentences_are_paged_and_opened_on_demand(page, tmp_path):
    sents = [" ".join(f"w{(k * 7 + i) % 50}" for i in range(3 + k % 9)) for k in range(300)]
    batch = text.encode(sents)
    traces = viz.batch_traces(batch)
    path = viz.write_explorer(traces, tmp_path / "many.html", names=viz.sentence_names(batch))
    html = path.read_text()
    assert html.count('class="ca-block"') == 2 * 300 + 1  # per sentence: tokens, heads; weights
    page.open(path)
    assert page.page.locator("[data-role=seq] option").count() == 300
    page.page.select_option("[data-role=seq]", index=299)
    L = int(batch.lengths[299])
    assert page.texts("[data-role=tokens] .ca-tok")[:L] == batch.tokens[299][:L]
    page.hover_row("A", L - 1)
    want = traces[299].select(0).A[L - 1][:L]
    assert [float(w) for w in page.side("weight")[:L]] == pytest.approx(want, abs=6e-4)
    page.clean()


def model_layers(L=3, H=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    toks = [f"tok{i}" for i in range(T)]
    toks[5] = toks[9] = "pizza"
    out = []
    for _ in range(L):
        W = [rng.normal(size=(8, 8)) for _ in range(3)]
        out.append(ca.trace(rng.normal(size=(T, 8)), *W, n_heads=H, tokens=toks))
    return out


def test_model_view_opens_a_head_and_search_pins_a_query(page, tmp_path):
    layers = model_layers()
    path = viz.write_explorer(layers, tmp_path / "model.html")
    page.open(path)
    assert page.page.locator("button.ca-thumb").count() == 6  # 3 layers × 2 heads
    assert page.page.locator("[data-role=head-summary] tr[data-head]").count() == 2
    page.page.locator("button.ca-thumb[data-layer='2'][data-head='1']").click()
    assert "layer 3 of 3" in page.page.inner_text("[data-role=summary]")
    assert page.page.input_value("[data-role=layer]") == "2"
    assert page.page.input_value("[data-role=head]") == "1"
    first = page.texts("[data-role=head-summary] tr[data-head='1'] td[data-col=first]")[0]
    assert first == f"{layers[2].A[1][:, 0].mean():.3f}"
    page.page.fill("[data-role=search]", "PIZ")
    assert page.page.inner_text("[data-role=search-count]") == "2 matches"
    assert page.page.locator("[data-role=tokens] .ca-tok-match").count() == 2
    page.page.press("[data-role=search]", "Enter")
    page.page.press("[data-role=search]", "Enter")  # the second match: query 10
    assert "query i = 10" in page.page.inner_text("[data-role=query-title]")
    assert page.page.is_checked("[data-role=pin]")
    page.hover_row("A", 2)  # pinned: hovering another row changes nothing
    assert "query i = 10" in page.page.inner_text("[data-role=query-title]")
    page.page.select_option("[data-role=layer]", index=0)  # the pinned query stays
    shown = [float(w) for w in page.side("weight")[:10]]
    assert shown == pytest.approx(layers[0].A[1][9][:10], abs=6e-4, rel=1e-2)
    page.page.uncheck("[data-role=pin]")
    page.hover_row("A", 2)
    assert "query i = 3" in page.page.inner_text("[data-role=query-title]")
    page.clean()


# the shared questions, one token of the first needing HTML escaping in the learn panel
QUESTIONS = copy.deepcopy(_helpers.QUESTIONS)
QUESTIONS[0]["data"]["tokens"][2] = "<b>x3</b>"


def _learn(page):
    return {
        r: page.page.inner_text(f"[data-role=learn-{r}]") for r in ("count", "feedback", "score")
    }


def test_check_yourself_panel_choose_check_hint_and_the_answer_on_its_matrix(page, tmp_path):
    path = viz.write_explorer(chapter_trace(), tmp_path / "learn.html", questions=QUESTIONS)
    page.open(path)
    assert _learn(page)["count"] == "question 1 of 2"
    page.page.click("[data-role=learn-check]")  # nothing chosen yet
    assert "Choose one answer first" in _learn(page)["feedback"]
    page.page.check("[data-role=learn-choices] input[data-choice='0']")  # the wrong one
    page.page.click("[data-role=learn-check]")
    fb = page.page.locator("[data-role=learn-feedback]")
    assert fb.get_attribute("data-correct") == "0"
    assert "across each query row" in fb.inner_text()
    pic = page.page.locator("[data-role=learn-picture]")
    assert pic.is_visible() and '"row":2' in pic.get_attribute("data-highlight")
    # the highlighted row is outlined on the picture: its border pixel is the highlight colour
    edge = page.page.evaluate("""() => {
        const c = document.querySelector('[data-role=learn-picture]');
        const [ml, mt, cell] = c.getAttribute('data-grid').split(',').map(Number);
        const d = window.devicePixelRatio || 1;
        return Array.from(c.getContext('2d').getImageData(
            (ml + cell * 1.5) * d, (mt + 2 * cell) * d, 1, 1).data).slice(0, 3);
    }""")
    assert edge == [232, 89, 12], edge
    assert page.page.locator("[data-role=learn-hint-text]").is_hidden()
    page.page.click("[data-role=learn-hint]")
    assert "must sum to 1" in page.page.inner_text("[data-role=learn-hint-text]")
    assert _learn(page)["score"].startswith("score: 0 of 1")
    page.page.click("[data-role=learn-next]")
    assert _learn(page)["count"] == "question 2 of 2"
    assert page.page.locator("[data-role=learn-picture]").is_hidden()
    page.clean()


def test_check_yourself_panel_by_keyboard_only(page, tmp_path):
    path = viz.write_explorer(chapter_trace(), tmp_path / "learn.html", questions=QUESTIONS)
    page.open(path)
    kb = page.page.keyboard
    page.page.focus("[data-role=learn-choices] input[data-choice='0']")
    kb.press("ArrowDown")  # moves the choice within the radio group: choice 2
    assert page.page.is_checked("[data-role=learn-choices] input[data-choice='1']")
    kb.press("Tab")  # "previous" is disabled on question 1: focus goes to "check"
    kb.press("Enter")
    assert page.page.locator("[data-role=learn-feedback]").get_attribute("data-correct") == "1"
    kb.press("Tab")
    kb.press("Enter")  # hint
    assert page.page.locator("[data-role=learn-hint-text]").is_visible()
    kb.press("Tab")
    kb.press("Enter")  # next
    assert _learn(page)["count"] == "question 2 of 2"
    assert _learn(page)["score"].startswith("score: 1 of 1")
    page.clean()


HOSTILE = [
    "<img src=x onerror=alert(1)>",
    "<script>window.__pwned = 1</script>",
    "</script><script>window.__pwned = 2</script>",
    '<b onmouseover="window.__pwned = 3">bold</b>',
    "&lt;&amp;\u2028<!--",
]


def _hostile_trace():
    rng = np.random.default_rng(1)
    T = len(HOSTILE)
    return ca.trace(
        rng.normal(size=(T, 4)), *(rng.normal(size=(4, 4)) for _ in range(3)), tokens=HOSTILE
    )


@pytest.mark.parametrize("form", ["page", "notebook fragment"])
def test_hostile_tokens_are_text_and_no_script_runs(page, tmp_path, form):
    tr = _hostile_trace()
    path = tmp_path / "hostile.html"
    if form == "page":
        viz.write_explorer(tr, path, names=[HOSTILE[0]], title=HOSTILE[2])
    else:  # as Jupyter would insert it: no Content-Security-Policy to help
        path.write_text(
            f"<!DOCTYPE html><meta charset='utf-8'><body>{tr._repr_html_()}</body>",
            encoding="utf-8",
        )
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
    print(
        f"\n2048-token explorer ({mib:.1f} MiB, 2 heads): navigation to drawn {in_page:.2f} s "
        f"in the page, {wall:.2f} s wall clock",
        file=sys.stderr,
    )
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


# -- the page's recompute against the reference, for every modifier and mask rule ---------
# Where the page is given Q and K (or X and shared weights), its JavaScript (js/decode.js,
# `recompute`) computes S and A itself, with softcap, ALiBi and sinks; every mask rule
# reaches it as the kinds of the cells, so each rule is a case too. Each must give
# causalattn.matrix_form's S and A to float64 rounding: |ΔA| ≤ 1e-12 and |ΔS| ≤ 1e-12·max(1, |S|)
# (the page works in float64 from float64 inputs here). Modifiers the page does not apply
# (bias, rel_bias, score_mod, ALiBi slopes per sequence) travel as the trace's own S and A
# in float32: |ΔA| ≤ 1e-6·max(1, |A|), as the reference's A rounded to float32.
T_REC, D_REC, H_REC = 9, 8, 2
RECOMPUTED = {  # name: (batch, pattern keywords); each with X W (form "x") and Q, K ("qk")
    "causal": (1, {}),
    "softcap": (1, {"softcap": 2.0}),
    "alibi": (1, {"alibi_slopes": np.array([0.5, 0.125])}),
    "alibi (1, H)": (1, {"alibi_slopes": np.array([[0.3, 0.7]])}),
    "sinks": (1, {"sinks": np.array([0.3, 2.5])}),
    "softcap, alibi, sinks, window": (
        2,
        {"softcap": 3.0, "alibi_slopes": np.array([0.5, 0.25]), "sinks": [-1.0, 1.5], "window": 4},
    ),
    "window": (1, {"window": 3}),
    "chunk": (1, {"chunk": 4}),
    "padding (lengths)": (2, {"lengths": [5, 9]}),
    "key_padding_mask": (2, {"key_padding_mask": np.arange(T_REC)[None] < np.array([[7], [9]])}),
    "prefix": (2, {"prefix_lengths": [3, 5]}),
    "documents": (1, {"cu_seqlens": [0, 4, 9]}),
    "mask": (1, {"mask": np.random.default_rng(7).random((T_REC, T_REC)) < 0.7}),
    "mask_mod": (1, {"mask_mod": lambda b, h, q, k: (q - k) % 3 != 1}),
    "not causal, padding": (2, {"causal": False, "lengths": [6, 9]}),
    "alibi, not causal": (1, {"alibi_slopes": np.array([0.5, 0.125]), "causal": False}),
    "chunk, sinks, softcap, padding": (
        2,
        {"chunk": 3, "sinks": [0.0, 1.0], "softcap": 1.5, "lengths": [7, 9]},
    ),
}
AS_THEY_ARE = {  # modifiers the page cannot apply: S and A travel as the trace's own
    "bias": (1, {"bias": np.random.default_rng(8).normal(size=(H_REC, T_REC, T_REC))}),
    "rel_bias": (1, {"rel_bias": np.random.default_rng(9).normal(size=(H_REC, 2 * T_REC - 1))}),
    "score_mod": (1, {"score_mod": lambda s, b, h, q, k: s * 0.5 + 0.1 * h}),
    "alibi per sequence": (2, {"alibi_slopes": np.array([[0.5, 0.25], [0.1, 0.9]])}),
}


def _recompute_case(batch, kw):
    rng = np.random.default_rng(11)
    W = [rng.normal(size=(D_REC, D_REC)) for _ in range(3)]
    tr = ca.matrix_form.trace(rng.normal(size=(batch, T_REC, D_REC)), *W, n_heads=H_REC, **kw)
    bare = ca.Trace(  # no X nor weights: the page is given Q and K
        {n: tr[n] for n in ("Q", "K", "V", "S", "A", "H")},
        n_heads=H_REC,
        allowed=tr.allowed,
        scale=tr.scale,
        pattern=tr.pattern,
    )
    return tr, [tr, bare]


def _page_heads(page) -> list[dict]:
    """Every head of the open page as the page's own decode module gives it (the same source
    the page inlines, a fresh instance over the page's data blocks): form, S and A (readable
    entries, row-major)."""
    return page.page.evaluate(
        "() => {\n"
        + viz.explorer.script_source("decode")
        + """
        const root = document.querySelector('.ca-explorer');
        const data = JSON.parse(root.querySelector('script.ca-data').textContent);
        const D = caDecode(root, data), out = [];
        data.sequences.forEach((q, s) => D.seqMeta(s).layers.forEach((lay, l) => {
          for (let h = 0; h < lay.n_heads; h++) {
            const hi = D.headInfo(s, l, h);
            out.push({ s: s, h: h, form: D.block(lay.block).heads[h].form,
                       S: Array.from(hi.S), A: Array.from(hi.A) });
          }
        }));
        return out;
      }"""
    )


def _check_heads(page, tr, path, forms):
    page.open(path)
    heads = _page_heads(page)
    B = tr.A.shape[0]
    allowed = np.broadcast_to(tr.allowed, tr.A.shape)
    assert len(heads) == 2 * B * H_REC  # the trace, then the bare trace: B sequences each
    for hd in heads:
        b, h = hd["s"] % B, hd["h"]
        al = allowed[b, h]
        want_A, want_S = tr.A[b, h][al], tr.S[b, h][al]
        assert hd["form"] == forms[hd["s"] // B], (hd["s"], hd["form"])
        if hd["form"] == "dense":
            np.testing.assert_allclose(hd["A"], want_A, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_allclose(hd["A"], want_A, rtol=0, atol=1e-12)
            scale = max(1.0, float(np.abs(want_S).max(initial=0)))
            np.testing.assert_allclose(hd["S"], want_S, rtol=0, atol=1e-12 * scale)
    page.clean()


@pytest.mark.parametrize("name", list(RECOMPUTED))
def test_page_recompute_is_the_reference(page, tmp_path, name):
    batch, kw = RECOMPUTED[name]
    tr, traces = _recompute_case(batch, kw)
    path = viz.write_explorer(traces, tmp_path / "rec.html", layers=False)
    _check_heads(page, tr, path, forms=("x", "qk"))


@pytest.mark.parametrize("name", list(AS_THEY_ARE))
def test_modifiers_the_page_cannot_apply_travel_as_they_are(page, tmp_path, name):
    batch, kw = AS_THEY_ARE[name]
    tr, traces = _recompute_case(batch, kw)
    path = viz.write_explorer(traces, tmp_path / "as_is.html", layers=False)
    _check_heads(page, tr, path, forms=("dense", "dense"))
