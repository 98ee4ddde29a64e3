"""A user's own code named ``package.module:attribute``: load it here, and find the local files that Ray must ship
so that its workers can load it too.

A run names the user's code this way (a reward term, a tool, an evaluation task class). This process can import
it (its ``sys.path``: the working directory, ``PYTHONPATH``), but a Ray worker runs elsewhere, in Ray's session
directory or on another node. :func:`module_paths` finds each named module that is neither part of this project
nor an installed package, as the directory of its top-level package or its single ``.py`` file: what Ray's
``runtime_env`` ``py_modules`` takes.
"""
from __future__ import annotations

import importlib
import importlib.util
import sysconfig
from pathlib import Path
from typing import Any, Iterable, List

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def load_object(name: str, what: str) -> Any:
    """``package.module:attribute`` -> the attribute; a ValueError naming ``what`` was asked for and why not."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"{what} {name!r} is not 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {what} {name!r}: {type(e).__name__}: {e}") from None


def callable_object(name: str, what: str) -> Any:
    """:func:`load_object` that must be callable (a reward term, a tool)."""
    obj = load_object(name, what)
    if not callable(obj):
        raise ValueError(f"{what} {name!r} is a {type(obj).__name__}, not a callable")
    return obj


def _installed_roots() -> List[Path]:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return [Path(r).resolve() for r in roots if r]


def module_paths(names: Iterable[str]) -> List[str]:
    """Local paths to ship as ``py_modules`` for ``package.module:attribute`` names: each one's top-level package
    directory or module file that lies outside this project and outside the interpreter's installed packages."""
    out: List[str] = []
    skip = [PROJECT_ROOT, *_installed_roots()]
    for name in names:
        top = name.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top) if top else None
        if spec is None:
            continue  # config validation has refused it already
        if spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations))).resolve()
        elif spec.origin and spec.origin.endswith(".py"):
            path = Path(spec.origin).resolve()
        else:
            continue  # a built-in or compiled module: installed with the interpreter
        if any(path == root or root in path.parents for root in skip):
            continue
        if str(path) not in out:
            out.append(str(path))
    return out
