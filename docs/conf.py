"""Sphinx configuration of the grpo-mega docs (Markdown through MyST).

    make docs        # builds docs/_build/html with warnings as errors

Theme: furo (a wide content column for commands and tables, an on-page table of contents,
light and dark modes); sphinx-copybutton puts a copy button on every code block (prompts and
printed output are not copied). The figures are drawn at build time from real outputs and
the code by the local extension ``_ext/grpo_figures.py`` into ``_generated/``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

project = "grpo-mega"
author = "grpo-mega developers"
extensions = ["myst_parser", "sphinx_copybutton", "grpo_figures"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_ext", "data"]
myst_heading_anchors = 3          # `page.md#section` links resolve, and are checked
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = "grpo-mega"
html_theme_options = {"navigation_with_keys": True}
# Copy commands, not the "$ " / ">>> " prompts or the lines a command printed.
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False
nitpicky = True
