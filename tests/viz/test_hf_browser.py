"""`causalattn explore --model DIR "text"` in headless Chromium: a tiny sliding-window model
saved with save_pretrained, its page offline and clean; the trained induction model
(examples/induction) with its heads' roles and generated tokens, which makes
docs/model_view.png (written there only with CAUSALATTN_WRITE_DOCS=1; else into the
test's tmp folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402
from test_explorer_browser import browser, page  # noqa: E402,F401  (the shared fixtures)
from typer.testing import CliRunner  # noqa: E402

from causalattn.cli import app  # noqa: E402
from causalattn.inspect import head_roles  # noqa: E402
from causalattn.integrations import hf_model  # noqa: E402
from causalattn.integrations.transformers import _accepted, capture  # noqa: E402
from causalattn.learn.induction import WORDS  # noqa: E402

pytestmark = pytest.mark.browser
ROOT = Path(__file__).resolve().parents[2]
DOCS_PNG = ROOT / "docs" / "model_view.png"
INDUCTION = ROOT / "examples" / "induction"
WORDS_TEXT = " ".join(WORDS[:12] + WORDS[:4])  # 12 words, then their first 4 again
TEXT = "The cat sat on the mat and looked at the dog."


def test_model_view_of_a_saved_model(page, tmp_path):  # noqa: F811
    if "window" not in _accepted():
        pytest.skip("causalattn.attention does not take window yet")
    d = tmp_path / "mistral"
    tiny.model("mistral").save_pretrained(d)
    tiny.tokenizer().save_pretrained(d)
    html = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["explore", "--model", str(d), TEXT, "-o", str(html)])
    assert res.exit_code == 0, (res.output, res.exception)
    page.open(html)
    assert page.page.locator("button.ca-thumb").count() == 8  # 2 layers × 4 heads
    shot = page.page.screenshot()
    page.page.locator("button.ca-thumb[data-layer='1'][data-head='3']").click()
    assert "layer 2 of 2" in page.page.inner_text("[data-role=summary]")
    assert page.page.screenshot() != shot  # choosing a layer/head changes the view
    assert " cat" in page.texts("[data-role=tokens] *")  # the tokenizer's readable pieces
    page.hover_row("A", 10, 2)  # query 11 reads keys 8..11 only: key 3 is outside the window
    assert "outside the window" in page.page.inner_text("[data-role=cell]")
    page.clean()


def test_model_view_of_the_trained_induction_model(page, tmp_path):  # noqa: F811
    """The roles read off the trained model's heads, the induction head opened, the tokens
    it generated marked: the heads guide's picture."""
    html = tmp_path / "induction.html"
    args = ["explore", "--model", str(INDUCTION), WORDS_TEXT, "--generate", "8", "-o", str(html)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    model, tok = hf_model.load(INDUCTION)
    ids = tok(WORDS_TEXT, return_tensors="pt")["input_ids"]
    roles = head_roles(capture(model, ids, generate=8))
    best = max(roles, key=lambda r: r.induction)
    page.open(html)
    thumbs = page.page.locator("button.ca-thumb")
    assert thumbs.count() == len(roles) == 8
    shown = [b.get_attribute("data-role-name") for b in thumbs.all()]
    assert shown == [r.role for r in roles]  # the page's roles are head_roles'
    assert "previous-token" in shown[:4] and shown[4 * best.layer + best.head] == "induction"
    gen = page.page.locator("[data-role=tokens] .ca-tok-gen")
    assert gen.count() == 8 and page.texts("[data-role=tokens] .ca-tok-gen")[:4] == list(
        WORDS[4:8]
    )  # the model goes on copying
    sel = f"button.ca-thumb[data-layer='{best.layer}'][data-head='{best.head}']"
    page.page.locator(sel).click()
    row = page.page.locator("[data-role=head-summary] tr.ca-cur")
    assert row.locator("td[data-col=role]").inner_text() == "induction"
    assert row.locator("td[data-col=induction]").inner_text() == f"{best.induction:.3f}"
    assert "the last 8 generated" in page.page.inner_text("[data-role=summary]")
    i = len(WORDS_TEXT.split()) + 1  # 0-based row of the first generated token (after <s>)
    page.hover_row("A", i, i - 11)  # it reads the token after the earlier copy of its input
    page.clean()
    page.page.locator("[data-role=model]").scroll_into_view_if_needed()
    # the picture in docs/ is refreshed on request only: a test run leaves the checkout as it was
    shot = DOCS_PNG if os.environ.get("CAUSALATTN_WRITE_DOCS") else tmp_path / DOCS_PNG.name
    page.page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
