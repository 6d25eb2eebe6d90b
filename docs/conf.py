"""Sphinx configuration of the grpo-mega docs (Markdown through MyST).

    make docs        # builds docs/_build/html with warnings as errors
"""
project = "grpo-mega"
author = "grpo-mega developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3          # `page.md#section` links resolve, and are checked
myst_enable_extensions = ["colon_fence"]
html_theme = "alabaster"
html_title = "grpo-mega"
nitpicky = True
