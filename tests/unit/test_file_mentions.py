"""Every mention of one of this repository's files names a file that exists (issue 48): in README.md, docs/*.md and
cluster/'s READMEs, in the docstrings and comments of the Python code, and in the comments of the shell scripts, YAML
recipes and Makefile. No Ray, no torch: a second.

What is checked:
- a path from the repository's root (``minimind_ray/``, ``bench/``, ``pipelines/``, ``tests/``, ``cluster/``,
  ``docs/``) ending in .py, .sh, .yaml or .md: it must exist;
- a path from one of minimind_ray's rooms (``engine/loop.py``, ``rl/plan.py``): it must exist in that room;
- in code, a bare file name ending in .py: a file of that name must exist in the repository (or beside the mentioning file);
- a name after a Python file's mention (``raytrain/driver.py:finish``, ``stages/stage.py:Stage.parents``): that file
  (any file of that name, for a bare one) must define it: a function, a class, a method or a module-level name.

Another project's file is written with its owner just before it ("MiniMind's ``model/model_minimind.py``", "Ray's
``default_worker.py``", a user's ``my_rewards.py``): those are not checked. A file that is gone on purpose, named to
tell its history, stands after "Before issue N" (the issue that removed it) in the same paragraph, as
docs/architecture.md's "Before issue 33 a stage took a row in ..." does."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[2]
TOPS = ("minimind_ray", "bench", "pipelines", "tests", "cluster", "docs")
ROOMS = {p.name for p in (REPO / "minimind_ray").iterdir() if (p / "__init__.py").exists()}
MENTION = re.compile(r"(?<![\w/.<>*-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*\.(?:py|sh|yaml|md))(?![\w/])")
NAMED = re.compile(r"(?<![\w/.<>*-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
OWNER = re.compile(r"MiniMind|Ray's|user")  # in the 40 characters before a mention: another project's, or a user's
GONE = re.compile(r"\bbefore issue \d+", re.IGNORECASE)


def _files(*patterns: str) -> List[Path]:  # never "**" from the root: .venv is there
    return sorted(p for pat in patterns for p in REPO.glob(pat) if "__pycache__" not in p.parts)


DOCS = _files("README.md", "docs/*.md", "cluster/**/*.md")
CODE = _files(*(f"{top}/**/*.py" for top in TOPS))
COMMENTED = _files(*(f"{top}/**/*.sh" for top in TOPS), "pipelines/configs/*.yaml", "cluster/**/*.yaml", "Makefile",
                   ".ci/run")
BASENAMES = {p.name for p in CODE}


def texts(path: Path) -> Iterator[Tuple[int, str, bool]]:
    """(first line, text, is code) of each paragraph-bearing text of a file: a markdown file whole; a Python file's
    docstrings and its blocks of comment lines; another file's blocks of comment lines."""
    src = path.read_text(errors="replace")
    if path.suffix == ".md":
        yield 1, src, False
        return
    comments: List[Tuple[int, str]] = []
    if path.suffix == ".py":
        tree = ast.parse(src)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                yield body[0].lineno, body[0].value.value, True
        comments = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
                    if t.type == tokenize.COMMENT]
    else:
        comments = [(n, line.strip()) for n, line in enumerate(src.splitlines(), 1) if line.strip().startswith("#")]
    block: List[Tuple[int, str]] = []
    for n, text in comments + [(-1, "")]:
        if block and n != block[-1][0] + 1:
            yield block[0][0], "\n".join(t for _, t in block), True
            block = []
        block.append((n, text))


def exists(mention: str, path: Path, code: bool) -> bool:
    parts = mention.split("/")
    if parts[0] in TOPS:
        return (REPO / mention).exists()
    if len(parts) > 1:
        return parts[0] not in ROOMS or (REPO / "minimind_ray" / mention).exists() or (path.parent / mention).exists()
    return not code or not mention.endswith(".py") or mention in BASENAMES or (path.parent / mention).exists()


def candidates(mention: str, path: Path) -> List[Path]:
    """The files a mention may name: from the root, from a room, beside the mentioning file, or any of that name."""
    found = [p for p in (REPO / mention, REPO / "minimind_ray" / mention, path.parent / mention) if p.is_file()]
    return found or [p for p in CODE if p.name == mention.rsplit("/", 1)[-1]]


def defined_names(p: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(p.read_text(errors="replace"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def names_defined(mention: str, name: str, path: Path) -> bool:
    """Whether ``mention``'s file defines ``name`` (``Class.method``: both)."""
    files = candidates(mention, path)
    return not files or any(set(name.split(".")) <= defined_names(p) for p in files)


def stale(path: Path) -> List[str]:
    """One line per mention in ``path`` of a file that does not exist, or of a name its file does not define."""
    found, name = [], path.relative_to(REPO) if REPO in path.parents else path.name
    for first, text, code in texts(path):
        for m in MENTION.finditer(text):
            mention = m.group(1)
            if exists(mention, path, code) or OWNER.search(text[max(0, m.start() - 40):m.start()]):
                continue
            paragraph = text[:m.start()].rsplit("\n\n", 1)[-1]
            if GONE.search(paragraph):
                continue
            found.append(f"{name}:{first + text.count(chr(10), 0, m.start())}: {mention}")
        for m in NAMED.finditer(text):
            mention, named = m.group(1), m.group(2)
            if not exists(mention, path, code) or names_defined(mention, named, path) or \
                    OWNER.search(text[max(0, m.start() - 40):m.start()]) or \
                    GONE.search(text[:m.start()].rsplit("\n\n", 1)[-1]):
                continue
            found.append(f"{name}:{first + text.count(chr(10), 0, m.start())}: {mention}:{named}")
    return found


def test_every_mentioned_file_exists():
    found = [line for path in DOCS + CODE + COMMENTED for line in stale(path)]
    assert not found, ("mentions of files that do not exist (rename the mention; a file gone on purpose stands after "
                       "'Before issue N' in its paragraph):\n" + "\n".join(found))


def test_a_stale_mention_is_found_and_a_gone_or_foreign_one_is_not(tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text("Training runs in `engine/loop.py` and `minimind_ray/engine/nowhere.py`; see `rl/old_step.py`.\n\n"
                   "Before issue 33 an objective lived in `engine/objectives.py`.\n\n"
                   "MiniMind's `model/model_minimind.py`, and `bench/bench_serve.py`.\n")
    assert stale(doc) == ["notes.md:1: minimind_ray/engine/nowhere.py", "notes.md:1: rl/old_step.py"]


def test_a_name_its_file_does_not_define_is_found(tmp_path):
    doc = tmp_path / "notes.md"
    doc.write_text("The run ends in `raytrain/driver.py:finish`, not `raytrain/driver.py:_finish`; the record's "
                   "`stages/stage.py:Stage.parents`, not `stages/stage.py:Stage.ancestors`.\n\n"
                   "Before issue 56 `config.py:gone` was there.\n")
    assert stale(doc) == ["notes.md:1: raytrain/driver.py:_finish", "notes.md:1: stages/stage.py:Stage.ancestors"]
