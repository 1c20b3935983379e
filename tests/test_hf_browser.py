"""`causalattn explore --model DIR "text"` in headless Chromium: a tiny sliding-window model
saved with save_pretrained, its page offline and clean; makes docs/model_view.png."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402
from test_explorer_browser import browser, page  # noqa: E402,F401  (the shared fixtures)
from typer.testing import CliRunner  # noqa: E402

from causalattn.cli import app  # noqa: E402
from causalattn.integrations.transformers import _accepted  # noqa: E402

pytestmark = pytest.mark.browser
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "model_view.png"
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
    page.page.locator("button.ca-thumb[data-layer='0'][data-head='0']").scroll_into_view_if_needed()
    page.page.screenshot(path=str(DOCS_PNG), full_page=True)
    assert DOCS_PNG.stat().st_size > 10_000
