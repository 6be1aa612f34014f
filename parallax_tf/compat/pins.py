"""Resolving a shim's PINNED table: which pinned names the installed dependency no longer has."""
from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Sequence, Tuple


def owner_of(where: str):
    """The module, or the attribute of a module (a class), that the dotted path `where` names."""
    parts = where.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(where)


def unresolved(pinned: Sequence[Tuple[str, str, str]], samples: Dict[str, Callable[[], object]]) -> List[str]:
    """The pinned (where, name, use) entries whose `where` has no `name`, as where.name. A
    `where` found in `samples` is an instance (made by samples[where]()): for attributes an
    object sets on itself when it is made."""
    gone = []
    for where, name, _ in pinned:
        try:
            owner = samples[where]() if where in samples else owner_of(where)
            found = hasattr(owner, name)
        except (ImportError, AttributeError):
            found = False
        if not found:
            gone.append(f"{where}.{name}")
    return gone
