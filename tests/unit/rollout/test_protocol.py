"""``RolloutEngineProtocol`` holds every engine member the trainer and the bridge use."""
from __future__ import annotations

import ast
from pathlib import Path

from grpo_mega.rollout import RolloutEngineProtocol

PKG = Path(__file__).resolve().parents[3] / "grpo_mega"


def _engine_members_used(paths) -> set[str]:
    """Attribute names read off anything called ``engine`` (``t.engine.x``, ``engine.x``)."""
    used = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                base = node.value
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if name == "engine":
                    used.add(node.attr)
    return used


def test_protocol_covers_what_the_trainer_calls_on_its_engine():
    """Guards against the trainer calling an engine member the protocol lacks
    (``generate_resharded`` was called but not declared), so an engine written to the
    protocol, as the docs invite, would fail at the first rollout."""
    used = _engine_members_used([*(PKG / "trainer").glob("*.py"), PKG / "train.py",
                                 *(PKG / "bridge").glob("*.py")])
    declared = ({n for n in dir(RolloutEngineProtocol) if not n.startswith("_")}
                | set(RolloutEngineProtocol.__annotations__))  # methods, and data members
    assert "generate_resharded" in used
    assert used <= declared, f"used on an engine but not in RolloutEngineProtocol: {sorted(used - declared)}"
