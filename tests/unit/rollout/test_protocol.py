"""``RolloutEngineProtocol`` holds every engine member the trainer and the bridge use."""
from __future__ import annotations

import ast
from pathlib import Path

from grpo_mega.rollout import AdapterRolloutEngineProtocol, AsyncRolloutEngineProtocol, RolloutEngineProtocol

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
    def declared(proto) -> set[str]:
        names = set()
        for cls in proto.__mro__:  # methods, and data members (annotations of each level)
            names |= {n for n in vars(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))
        return names - {"register"}

    sync = _engine_members_used([p for p in (PKG / "trainer").glob("*.py") if p.name != "pipeline.py"]
                                + [PKG / "train.py", *(PKG / "bridge").glob("*.py")])
    every = sync | _engine_members_used([PKG / "trainer" / "pipeline.py"])
    assert "generate_resharded" in sync and {"submit", "collect"} <= every
    # The asynchronous pipeline and the separate-placement branches may use the async API;
    # every member used anywhere must be declared by one of the two protocols.
    extra = declared(AsyncRolloutEngineProtocol) - declared(RolloutEngineProtocol)
    assert extra == {"next_version", "submit", "collect"}, extra
    # model.lora.sync=adapter calls two more, declared by their own protocol (the bridge
    # checks an engine has them before using them)
    adapter = declared(AdapterRolloutEngineProtocol) - declared(RolloutEngineProtocol)
    assert adapter == {"load_adapter", "probe_adapter"}, adapter
    known = declared(AsyncRolloutEngineProtocol) | adapter
    assert every <= known, f"used on an engine but in no protocol: {sorted(every - known)}"
    assert sync - {"next_version"} - adapter <= declared(RolloutEngineProtocol), (
        f"used on an engine but not in RolloutEngineProtocol: {sorted(sync - declared(RolloutEngineProtocol))}")
