"""The house rules of docs/architecture.md, checked on the source: its table of rooms and what each may import, no
import circle between modules or between rooms, Ray only where it belongs, no module over 450 lines, no stage name
compared outside the stages room, no private name imported across modules, a reason for each import inside a function.
Every import counts, including the ones inside functions. bench/ is checked as a client of the library: no private
name, no test module, a reason for each import inside a function."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "minimind_ray"
MAX_LINES = 450
# Ray Train is used by the Ray layer only; Ray itself (actors, Ray Data, Serve) also by these.
RAY_TRAIN_ROOMS = {"raytrain"}
# rl: a reward model on a shared actor (placement: actor); evals: `eval --workers N` shards a task over Ray tasks;
# console: the filter in front of Ray's printer of the workers' lines (a quiet terminal, issue 38)
RAY_ROOMS = {"raytrain", "serve", "data", "rl", "evals", "console"}


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


def _registry_edges(package: str, names: str):
    """A registry's ``__init__.py`` imports its modules by name (stages/: STAGE_MODULES, data/formats/:
    FORMAT_MODULES): edges the AST cannot see."""
    tree = ast.parse((PKG.joinpath(*package.split(".")) / "__init__.py").read_text())
    modules = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == names)
    return {f"minimind_ray.{package}.{n}" for n in modules}


def _room_graph():
    """room -> {(imported room, importing module)}, every import counted (inside functions too)."""
    _, internal, _ = _graph()
    internal["minimind_ray.stages"] |= _registry_edges("stages", "STAGE_MODULES")
    internal["minimind_ray.data.formats"] |= _registry_edges("data.formats", "FORMAT_MODULES")
    rooms = defaultdict(set)
    for mod, targets in internal.items():
        for t in targets:
            if _room(t) and _room(t) != _room(mod):
                rooms[_room(mod)].add((_room(t), mod))
    return rooms


def _table():
    """docs/architecture.md's rooms: room -> the rooms it may import (None: every room)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    body = text.split("<!-- rooms:", 1)[1].split("<!-- /rooms -->", 1)[0]
    allowed = {}
    for row in body.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rooms = [r.split("/")[0].removesuffix(".py") for r in re.findall(r"`([^`]+)`", cells[0])]
        rule = re.sub(r"\([^)]*\)", "", cells[2]).strip()
        may = None if rule == "everything" else set() if rule == "nothing" else {r.strip() for r in rule.split(",")}
        for r in rooms:
            allowed[r] = may
    return allowed


def test_the_architecture_table_lists_every_room_and_only_rooms():
    actual = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
              if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    table = _table()
    assert set(table) == actual, f"not in the table: {sorted(actual - set(table))}; gone: {sorted(set(table) - actual)}"
    named = {r for may in table.values() if may for r in may}
    assert named <= actual, f"the table lets rooms import what does not exist: {sorted(named - actual)}"


def test_every_import_is_one_the_architecture_table_allows():
    table = _table()
    wrong = sorted(f"{mod} imports {room} ({src} may import: {', '.join(sorted(table[src])) or 'nothing'})"
                   for src, edges in _room_graph().items() for room, mod in edges
                   if table.get(src) is not None and room not in table[src])
    assert not wrong, "imports the table of docs/architecture.md does not allow:\n" + "\n".join(wrong)


def test_no_circle_between_rooms():
    graph = {src: {room for room, _ in edges} for src, edges in _room_graph().items()}
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "circles between rooms: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_stage_name_is_compared_outside_the_stages_room():
    """What differs between stages is asked of their records (stages/stage.py), not switched on by name."""
    pattern = re.compile(r"stage\s*(==|!=|\bin\s*[\(\[{])")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for root in (PKG, REPO / "pipelines") for p in root.rglob("*.py") if "stages" not in p.relative_to(REPO).parts
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line) and "lifecycle_stage" not in line]
    assert not found, "stage switches outside minimind_ray/stages/:\n" + "\n".join(found)


def _stage_classes():
    """{class name: its module} of every class the stages room defines besides the record's own types."""
    out = {}
    for p in (PKG / "stages").glob("*.py"):
        if p.name != "stage.py":
            out.update({n.name: p.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)})
    return out


def test_no_isinstance_against_a_stage_class():
    """What a stage is, is asked of its record, not of the type of its objective, plan or section."""
    classes = _stage_classes()
    found = []
    for p in list(PKG.rglob("*.py")) + list((REPO / "pipelines").rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("isinstance", "issubclass") and len(n.args) == 2:
                named = {x.id if isinstance(x, ast.Name) else getattr(x, "attr", None) for x in ast.walk(n.args[1])}
                hit = sorted(c for c in named if c in classes and classes[c] != p.name)
                found += [f"{p.relative_to(REPO)}:{n.lineno}: isinstance against {c}" for c in hit]
    assert not found, "\n".join(found)


# sections read outside their stage's module, each with why: store/ cannot ask the lora stage's record (stages import
# store): the adapters' settings recorded with weights are read back as model/config.py's LoRAConfig, the type the
# record names as its section; the agent moves the train.grpo keys it read before its own section (issue 56) into
# train.agent, before the config is validated
SECTION_READS_ALLOWED = {"store/weights.py": {"lora"}, "stages/agent.py": {"grpo"}}


def test_a_stages_section_is_read_in_its_own_module_only():
    """``cfg.train.<stage>`` (or a recorded config's ``["train"]["<stage>"]``) is read by that stage's module
    (stages/<name>.py, its objective stages/<name>_objective.py) or by a stage whose record says it reads it."""
    import sys

    sys.path.insert(0, str(REPO))
    from minimind_ray.stages import STAGES

    recorded = re.compile(r"""["']train["'][^\n]{0,20}?["'](%s)["']""" % "|".join(STAGES))
    found = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        owner = p.stem[: -len("_objective")] if p.stem.endswith("_objective") else p.stem
        mine = set(STAGES[owner].section_names()) if rel.startswith("stages/") and owner in STAGES else set()
        mine |= SECTION_READS_ALLOWED.get(rel, set())
        text = p.read_text()
        read = {n.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Attribute) and n.attr in STAGES
                and isinstance(n.value, ast.Attribute) and n.value.attr == "train"}
        read |= {m.group(1) for m in recorded.finditer(text)}
        found += [f"minimind_ray/{rel}: train.{s}" for s in sorted(read - mine)]
    assert not found, "stage sections read outside their stage's module:\n" + "\n".join(found)


def test_no_format_name_is_compared_outside_the_formats_package():
    """What differs between record formats is asked of their records (data/formats/base.py:Format), not switched on
    by name: a format is its module and one line of data/formats/__init__.py."""
    pattern = re.compile(r"\b(format|fmt)\s*(==|!=|(not\s+)?in\s*[\(\[{])")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for root in (PKG, REPO / "pipelines") for p in root.rglob("*.py") if "formats" not in p.parent.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "format switches outside minimind_ray/data/formats/:\n" + "\n".join(found)


BENCH = REPO / "bench"
OWN = ("minimind_ray", "pipelines", "tests")  # the project's own code, besides bench/'s modules


def _bench_files():
    return sorted(BENCH.glob("*.py"))


def _own(module: str, level: int = 0) -> bool:
    """``module`` (as a ``from``/``import`` names it) is the project's own code, or a bench module (bench/common)."""
    top = module.split(".")[0]
    return bool(level) or top in OWN or (BENCH / f"{top}.py").exists()


def test_no_private_name_is_imported_from_another_module():
    """A leading underscore says "this module's own": another module that needs the name asks for a public one.
    bench/ is held to it too: a benchmark uses the library as its users do."""
    found = []
    files = [(name, path) for name, path in _modules().items()] + [(f"bench/{p.name}", p) for p in _bench_files()]
    for name, path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and _own(node.module or "", node.level):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Import):
                found += [f"{name} imports {a.name}" for a in node.names if _own(a.name) and any(
                    part.startswith("_") and not part.startswith("__") for part in a.name.split("."))]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_bench_imports_no_test():
    """A benchmark is a client of the library: what it needs from the suite (a fixture's data, a cluster's start) it
    reads or runs itself; a check with a verdict belongs in tests/ (tests/soak/ when make test must leave it out)."""
    assert _bench_files(), "no bench/*.py to check"
    found = [f"bench/{p.name}:{node.lineno}" for p in _bench_files() for node in ast.walk(ast.parse(p.read_text()))
             if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests")
             or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tests" for a in node.names))]
    assert not found, "bench/ imports the test suite:\n" + "\n".join(found)


def _lazy_reason(lines, node) -> bool:
    """``# lazy: <reason>`` on the import's own lines, or in the comment lines directly above it: each import its
    own reason (a reason above one import does not excuse the next)."""
    if re.search(r"# lazy: \S", "\n".join(lines[node.lineno - 1:node.end_lineno])):
        return True
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if re.search(r"# lazy: \S", lines[i]):
            return True
        i -= 1
    return False


def test_every_import_inside_a_function_says_why_it_is_there():
    """An import of the project's own code belongs at the module's top, where a reader sees what the module depends
    on. One that stays inside a function says why on its line, or in the comment lines directly above it
    (``# lazy: <reason>``: a heavy dependency such as torch, pyarrow or Ray that the verb may never need, a circle it
    would close, or in bench/ a before/after worker's tree that must come first on sys.path). bench/ too: its own
    code is the library, pipelines/ and bench's modules (bench/common.py)."""
    found = []
    files = list(_modules().values()) + _bench_files()
    for path in files:
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                internal = (isinstance(node, ast.ImportFrom) and _own(node.module or "", node.level)) or (
                    isinstance(node, ast.Import) and any(_own(a.name) for a in node.names))
                if internal and not _lazy_reason(lines, node):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not found, ("imports inside functions without a '# lazy: <reason>' (move them to the top, or say why):\n"
                       + "\n".join(sorted(set(found))))


def test_a_lazy_reason_excuses_its_own_import_only():
    src = ("def f():\n"
           "    # lazy: torch, only when this runs\n"
           "    # (a reason may take two comment lines)\n"
           "    from minimind_ray.model import minimind\n"
           "    from minimind_ray.store import pth\n"
           "    import minimind_ray.generate  # lazy: torch\n"
           "    from minimind_ray import export\n")
    lines = src.splitlines()
    imports = [n for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [_lazy_reason(lines, n) for n in sorted(imports, key=lambda n: n.lineno)] == [True, False, True, False]


def test_every_verb_is_one_module_named_for_it():
    """docs/architecture.md, "A new verb": each of cli.py's VERBS is ``<verb>_verb.py`` (a dash as ``_``) in the room
    that does its work; every stage's verb is raytrain/train_verb.py's; no other module is a verb's (``add_arguments``
    and ``run`` at its top level) or is named like one."""
    import sys

    sys.path.insert(0, str(REPO))
    from minimind_ray.cli import VERBS

    misnamed = [f"{verb}: {m.__name__}" for verb, m in VERBS.items()
                if m.__name__.rsplit(".", 1)[-1] != verb.replace("-", "_") + "_verb"]
    assert not misnamed, "verb modules not named <verb>_verb.py:\n" + "\n".join(misnamed)
    verbs = {m.__name__ for m in VERBS.values()} | {"minimind_ray.raytrain.train_verb"}
    named = {".".join(p.relative_to(PKG.parent).with_suffix("").parts) for p in PKG.rglob("*_verb.py")}
    assert named == verbs, f"modules named like a verb that are none: {sorted(named - verbs)}"
    acting = set()
    for name, path in _modules().items():
        defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if {"add_arguments", "run"} <= defined:
            acting.add(name)
    assert acting == verbs, f"modules holding a verb outside the verb modules: {sorted(acting - verbs)}"


def test_the_verbs_stage_is_never_a_dotted_override_string():
    """A training verb's (or a pipeline step's) stage reaches the config as a value (load_config's ``stage``), not as
    a ``train.stage=...`` string parsed back."""
    found = [f"{p.relative_to(REPO)}:{i}" for p in PKG.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"""f?["']train\.stage=""", line)]
    assert not found, "\n".join(found)
