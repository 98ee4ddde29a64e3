"""The house rules of docs/architecture.md, checked on the source: no import circle, Ray only where it
belongs, no module over 450 lines. Every import counts, including the ones inside functions."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "minimind_ray"
MAX_LINES = 450
# Ray Train is used by the Ray layer only; Ray itself (actors, Ray Data, Serve) also by these.
RAY_TRAIN_ROOMS = {"raytrain"}
# rl: a reward model on a shared actor (placement: actor); evals: `eval --workers N` shards a task over Ray tasks
RAY_ROOMS = {"raytrain", "serve", "data", "rl", "evals"}


def _modules():
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _imports(name: str, path: Path):
    """(imported module names) of one file, relative imports resolved."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def _graph():
    mods = _modules()
    internal, external = defaultdict(set), defaultdict(set)
    for name, path in mods.items():
        for target in _imports(name, path):
            if target.split(".")[0] != "minimind_ray":
                external[name].add(target)
                continue
            while target and target not in mods:  # `from pkg.mod import func` -> pkg.mod
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                internal[name].add(target)
    return mods, internal, external


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circle():
    mods, internal, _ = _graph()
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        stack.append(n)
        for m in sorted(internal[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = "done"

    for n in sorted(mods):
        if n not in state:
            visit(n, [])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_ray_is_imported_only_by_the_rooms_that_run_on_it():
    _, _, external = _graph()
    wrong_train = {m for m, ext in external.items()
                   if any(x == "ray.train" or x.startswith("ray.train.") for x in ext) and _room(m) not in RAY_TRAIN_ROOMS}
    wrong_ray = {m for m, ext in external.items()
                 if any(x == "ray" or x.startswith("ray.") for x in ext) and _room(m) not in RAY_ROOMS}
    assert not wrong_train, f"ray.train outside {RAY_TRAIN_ROOMS}: {sorted(wrong_train)}"
    assert not wrong_ray, f"ray outside {RAY_ROOMS}: {sorted(wrong_ray)}"


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
