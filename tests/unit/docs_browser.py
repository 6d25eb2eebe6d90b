"""The built site as a person sees it: every page rendered in headless Chromium.

The tests are in ``test_docs.py`` (this file's name keeps pytest from collecting it), which
imports the fixtures here so that they render its one Sphinx build (``built_site``) and calls
the ``check_*`` functions.

The Sphinx build (``test_docs.py``) catches a link to a missing page or heading in the
Markdown; it does not see what the browser then loads. These checks take that build and
open every page in Chromium (Debian's ``chromium``, driven by Playwright): a resource the
page asks for that does not load (a figure, the theme's CSS or JavaScript), an image that
does not decode, or a link inside the site to a missing file or anchor fails it.

Needs ``chromium`` on the PATH (``apt-get install chromium``; ``.ci/run`` installs it) and
the ``playwright`` package (the ``test`` extra); without them it skips and says which.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.unit.docs_commands import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIGURES = {"get-started.html": "demo-reward.svg", "concepts/step.html": "step-stages.svg",
           "guides/memory.html": "memory-budget.svg"}
"""Page -> the generated figure it must show."""

_PAGE_JS = """() => ({
  broken: [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
  images: [...document.images].map(i => i.src),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
})"""


@pytest.fixture(scope="module")
def site_html(built_site) -> Path:
    r, out = built_site
    if r.returncode != 0:
        pytest.skip("the site did not build (test_site_builds_with_warnings_as_errors... says why)")
    return out


@pytest.fixture(scope="module")
def rendered(site_html):
    """``{page: {broken, images, links, ids, failed}}`` for every HTML page of the site."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    pages = sorted(p for p in site_html.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)
    out = {}
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            failed: list[str] = []
            page.on("requestfailed", lambda req: failed.append(req.url))
            for html in pages:
                failed.clear()
                page.goto(html.as_uri(), wait_until="load")
                state = page.evaluate(_PAGE_JS)
                # the network is off: only the site's own files count as failures
                state["failed"] = [u for u in failed if u.startswith("file:")]
                out[html.relative_to(site_html).as_posix()] = state
        finally:
            browser.close()
    return out


def check_every_page_loads_every_resource_and_image(rendered):
    assert len(rendered) > 30, sorted(rendered)
    bad = {page: {"failed": s["failed"], "broken": s["broken"]}
           for page, s in rendered.items() if s["failed"] or s["broken"]}
    assert not bad, bad


def check_every_link_inside_the_site_reaches_a_page_and_anchor(rendered, site_html):
    bad = []
    for page, s in rendered.items():
        for href in s["links"]:
            url = urlparse(href)
            if url.scheme != "file":
                continue
            target = Path(unquote(url.path))
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                bad.append(f"{page}: {href} (no such file)")
                continue
            if url.fragment and target.suffix == ".html":
                rel = target.relative_to(site_html).as_posix()
                ids = rendered[rel]["ids"] if rel in rendered else re.findall(r'id="([^"]+)"', target.read_text())
                if unquote(url.fragment) not in ids:
                    bad.append(f"{page}: {href} (no anchor #{url.fragment})")
    assert not bad, bad[:20]


def check_the_figures_are_drawn_from_the_code_and_real_outputs(rendered, site_html):
    for page, figure in FIGURES.items():
        images = rendered[page]["images"]
        assert any(src.endswith("/" + figure) for src in images), (page, images)
    stages_svg = (site_html / "_images" / "step-stages.svg").read_text()
    # the stage list read here independently of the extension's parser: every line of the
    # entry point's docstring indented by exactly two spaces names a stage
    doc = (REPO / "grpo_mega" / "train.py").read_text().split('"""')[1]
    stages = [re.split(r"\s{2,}", line.strip())[0] for line in doc.splitlines() if re.match(r"^  \S", line)]
    assert len(stages) >= 8 and "sync" in stages, stages
    for stage in stages:
        assert stage in stages_svg, stage
    budget_svg = (site_html / "_images" / "memory-budget.svg").read_text()
    for cfg in sorted((REPO / "launch" / "configs").glob("*.yaml")):
        assert cfg.stem in budget_svg, cfg.stem
