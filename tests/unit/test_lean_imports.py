"""``grpo_mega.runtime.lean_imports``: megatron's timers do not import wandb (0.6 s of every
process that imports megatron-core), and nobody else is refused it."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture
def colorsys_blocked_for(monkeypatch):
    """The finder's rule pointed at a small stdlib module nobody here has imported."""
    from grpo_mega.runtime import lean_imports

    monkeypatch.setattr(lean_imports, "BLOCKED", {"colorsys": "pkg.timers"})
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    lean_imports.install()
    yield
    sys.modules.pop("colorsys", None)


def test_lean_imports_refuses_the_package_to_its_one_importer_only(colorsys_blocked_for):
    """Guards the finder refusing the package to everyone (a user's ``logging.wandb`` sink or
    reward function would lose wandb) or to no one (every process pays its import): the named
    importer gets ImportError, which megatron's ``try: import wandb`` turns into None, and any
    other module then imports the real package."""
    with pytest.raises(ImportError, match="lean_imports"):
        exec("import colorsys", {"__name__": "pkg.timers"})
    assert "colorsys" not in sys.modules
    scope = {"__name__": "grpo_mega.trainer.metrics"}
    exec("import colorsys", scope)
    assert scope["colorsys"].__name__ == "colorsys"


def test_lean_imports_is_installed_by_importing_grpo_mega_and_names_megatrons_timers():
    """Guards the block being dropped (install() no longer called from grpo_mega/__init__) or
    aimed at another module than the one that imports wandb."""
    import grpo_mega  # noqa: F401
    from grpo_mega.runtime import lean_imports

    assert lean_imports.BLOCKED == {"wandb": "megatron.core.timers"}
    assert any(isinstance(f, lean_imports._RefuseToOneImporter) for f in sys.meta_path)
