"""Lazy package faces (PEP 562): a package names what it exports and the module each
name lives in, and a name's module is imported on its first use. So ``import
tensordb.errors`` from a layer below the client does not load the client facade, and a
package's ``__init__`` needs no function-local imports to break a cycle.

Imports nothing of tensordb: it is the bottom of every package face that uses it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(package: str, names: Mapping[str, str], exported: Iterable[str], *,
              modules: Iterable[str] = ()) -> tuple[Callable[[str], Any],
                                                    Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``'s face. ``names`` maps each lazy
    name to its module (relative to the package, e.g. ``"._cluster"``); a name in
    ``modules`` is the module itself rather than an attribute of it. The value found is
    stored in the package's namespace, so later reads do not come back here."""
    modules = frozenset(modules)
    exported = sorted(exported)

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where, package)
        value = module if name in modules else getattr(module, name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exported))

    return __getattr__, __dir__
