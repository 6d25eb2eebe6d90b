"""The docs check of ``make test``: the site builds without a warning, the generated pages
are current, every config field is documented, and every command the docs show works.

One Sphinx build (a few seconds); the command checks load configs and run the trainer's
validation in-process (``docs_commands.check_command``), no process group or engine.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from tests.unit.docs_commands import REPO, check_command
from tests.unit import docs_browser
from tests.unit.docs_browser import rendered, site_html  # noqa: F401  (fixtures: one build, rendered once)

DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """One Sphinx build of the site, warnings as errors: ``(completed process, html dir)``;
    ``test_docs_browser.py``'s checks render the same build (``site`` there)."""
    out = tmp_path_factory.mktemp("site") / "html"
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-E",
                        "-b", "html", str(DOCS), str(out)], capture_output=True, text=True, timeout=300)
    return r, out


def test_site_builds_with_warnings_as_errors_and_every_link_resolves(built_site):
    """Guards against a broken page: a link to a page or a heading that does not exist (the
    old README had three), a page left out of every table of contents, bad MyST syntax, a
    figure the build could not draw."""
    r, _ = built_site
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def test_generated_pages_are_current():
    """Guards against reference pages that drift from the code: a config field, default,
    allowed value, tool flag, registry entry, tested layout or metric changed without
    ``python tools/gen_docs.py``."""
    sys.path.insert(0, str(REPO))
    from tools.gen_docs import generate

    stale = [name for name, text in generate().items()
             if not (DOCS / name).is_file() or (DOCS / name).read_text() != text]
    assert not stale, f"stale generated docs: {stale}; run `python tools/gen_docs.py`"


def test_every_config_field_has_a_docstring():
    """Guards against a config field nobody can look up (51 of 121 were never mentioned in
    the README): each field carries the docstring the reference page and --help show."""
    from grpo_mega.config import Config, field_docs

    missing = []
    for sec in dataclasses.fields(Config):
        cls = sec.default_factory().__class__
        docs = field_docs(cls)
        missing += [f"{sec.name}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
        if not field_docs(Config).get(sec.name):
            missing.append(sec.name)
    assert not missing, f"config fields without a docstring: {missing}"


def shell_commands(text: str) -> list[str]:
    """The commands of the fenced ``bash`` blocks of a Markdown text, continuations joined,
    comments dropped."""
    cmds = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
            cmd = cmd.strip()
            if cmd and not cmd.startswith("#"):
                cmds.append(cmd)
    return cmds


COMMANDS = [(p.relative_to(REPO).as_posix(), c) for p in [REPO / "README.md", *PAGES]
            for c in shell_commands(p.read_text())]


def test_the_docs_show_commands():
    """Guards against the command check silently checking nothing (a fence renamed)."""
    assert len(COMMANDS) > 30 and any(f == "README.md" for f, _ in COMMANDS)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{f}:{i}" for i, (f, _) in enumerate(COMMANDS)])
def test_every_command_in_the_docs_parses_and_validates(where, command):
    """Guards against launch examples that stop before step 1 (the old README's multi-node
    and sbatch lines left out paths start-up requires), a flag or file that does not exist,
    and a layout the named model's real shape does not allow."""
    check_command(command)


def test_troubleshooting_names_every_fault_injection_point():
    """Guards against the fault-injection list drifting from the code (the page listed 7
    points when the code had 10): every point of ``grpo_mega.runtime.faults.POINTS`` is named, in
    backticks, in the paragraph that documents ``GRPO_MEGA_FAULT``."""
    from grpo_mega.runtime.faults import POINTS

    text = (DOCS / "troubleshooting.md").read_text()
    para = text[text.index("**Fault injection**"):]
    para = para[:para.index("\n\n")]
    missing = [p for p in POINTS if f"`{p}`" not in para]
    assert not missing, missing


def test_every_page_loads_every_resource_and_image(rendered):
    """Guards against a page that renders with a hole: a figure the build did not generate
    or a path that points elsewhere (the image is then blank or an alt text), a theme
    asset missing from the build, an image that does not decode."""
    docs_browser.check_every_page_loads_every_resource_and_image(rendered)


def test_every_link_inside_the_site_reaches_a_page_and_anchor(rendered, site_html):
    """Guards against links Sphinx does not check: raw HTML, a generated page's link, a
    link into a page that was renamed, or an anchor that no longer exists on its page."""
    docs_browser.check_every_link_inside_the_site_reaches_a_page_and_anchor(rendered, site_html)


def test_the_figures_are_drawn_from_the_code_and_real_outputs(rendered, site_html):
    """Guards against figures that exist only on a desk: the demo curve, the step's stages
    and the memory budget are generated by the docs build (``docs/_ext/grpo_figures.py``)
    and shown, decoded, on their pages; the stage diagram names every stage the trainer's
    entry point lists, and the budget chart every shipped config."""
    docs_browser.check_the_figures_are_drawn_from_the_code_and_real_outputs(rendered, site_html)
