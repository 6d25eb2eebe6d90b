"""The project's rule "no module over 500 lines" (docs/concepts/architecture.md), checked."""
from __future__ import annotations

from tests import REPO

LIMIT = 500


def test_no_module_over_500_lines():
    """Guards the legibility rule silently eroding: gateway/core.py and preflight/validate.py
    had grown to 502 and 501 lines with nothing noticing. Every Python module of the package,
    the tools and the benchmarks must stay within 500 lines; split by concern when one grows."""
    over = {}
    for folder in ("grpo_mega", "tools", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > LIMIT:
                over[str(path.relative_to(REPO))] = n
    assert not over, f"modules over {LIMIT} lines (split them by concern): {over}"
