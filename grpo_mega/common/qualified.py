"""``"package.module:attr"`` names, as configs use them for custom rewards, environments and
chat formats: one importer, so every registry reports a bad name the same way. Imports
nothing of ours."""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_qualified"]


def import_qualified(name: str, what: str, kind: str = "callable") -> Any:
    """The attribute ``attr`` of module ``package.module`` for ``name =
    "package.module:attr"``. ``what`` names the setting in errors (``"reward 'x:y'"``);
    ``kind`` is what the attribute must be: ``"callable"`` (checked) or anything else
    (returned as found, the caller checks it). ImportError when the module does not
    import, AttributeError when the attribute is missing (or, for ``callable``, not one)."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"{what}: cannot import module {module_name!r}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None or (kind.endswith("callable") and not callable(obj)):
        raise AttributeError(f"{what}: module {module_name!r} has no {kind} {attr!r}")
    return obj
