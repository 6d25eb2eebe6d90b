"""Keep megatron-core from importing wandb at start-up (0.4 s of every process).

``megatron.core.timers`` runs ``try: import wandb`` when megatron.core is imported, for
Megatron-LM's own loggers, which grpo-mega never uses; with wandb installed that costs every
rank, engine server and test process about 0.4 s. ``install()`` adds a finder that refuses
``wandb`` to that one module only (its ``except ImportError`` then leaves it None); every other
importer, our ``logging.wandb`` sink included, gets the real package.
"""
from __future__ import annotations

import sys

BLOCKED = {"wandb": "megatron.core.timers"}
"""Package -> the only module refused it."""


class _RefuseToOneImporter:
    """A ``sys.meta_path`` finder: ImportError for ``wandb`` when megatron's timers import it."""

    def find_spec(self, name, path=None, target=None):
        importer = BLOCKED.get(name)
        if importer is None:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == importer:
                raise ImportError(f"{name} is not imported for {importer} (grpo_mega.runtime.lean_imports)")
            frame = frame.f_back
        return None


def install() -> None:
    """Idempotent; a no-op once megatron.core.timers is imported."""
    if "megatron.core.timers" in sys.modules or any(isinstance(f, _RefuseToOneImporter) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RefuseToOneImporter())
