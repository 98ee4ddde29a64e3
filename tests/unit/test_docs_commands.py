"""Every example command of the README and the docs works as written (issue 38): each one is taken from the markdown
(fenced blocks, and inline `minimind-ray ...` / `python -m pipelines....` spans), parsed by the CLI's own parser, and
its config part resolved and validated as the verb would, before any Ray work: a training verb's recipe and dotted
overrides (load_config + validate), a pipeline's and a sweep's YAML with each recipe they name, `make` targets, the
flags of `python bench/*.py` scripts and `python -m tests.soak.*` checks, and `pytest` runs of tests/soak/ (the files
exist, the options are tests/soak/conftest.py's). Files a command names that this machine does not have (a user's
/data/pretrain_hq.jsonl, runs/<run>) are the only thing stood in for. No Ray, no torch work: a second or two."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import io
import os
import re
import shlex
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "cluster" / "README.md"]
COMMAND = (r"(?:\.venv/bin/)?minimind-ray\s|(?:\.venv/bin/)?python3?\s+(?:-m\s+(?:pipelines\.|tests\.|pytest\s)|bench/)"
           r"|make\s+\w")
# a fenced block's line that is a command: one of ours, or `ray job submit ... -- <ours>`, after any VAR=value
START = re.compile(rf"^(?:\$\s+)?((?:[A-Z_]+=\S*\s+)*(?:{COMMAND}|ray\s+job\s+submit\s))")
INLINE = re.compile(rf"^(?:{COMMAND})")
SHELL = ("", "bash", "sh", "shell", "console")


def commands(text: str) -> Iterator[Tuple[int, str, bool]]:
    """(line, command, whole): every command of a markdown text; ``whole`` for a fenced block's line (a command as
    typed), not for an inline span (often a verb and the flag the prose is about)."""
    fence = None
    logical, first = "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = line.strip()[3:].strip() if fence is None else None
            continue
        if fence is None or fence not in SHELL:
            continue
        logical, first = (logical + " " + line.rstrip("\\").strip(), first or n)
        if line.rstrip().endswith("\\"):
            continue
        m = START.match(logical.strip())
        if m:
            yield first, logical.strip()[m.start(1):], True
        logical, first = "", 0
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        span = " ".join(m.group(1).split())
        if INLINE.match(span) and not _in_fence(text, m.start()):
            yield text.count("\n", 0, m.start()) + 1, span, False


def _in_fence(text: str, pos: int) -> bool:
    return text.count("\n```", 0, pos) % 2 == 1


def _synopsis(argv: List[str]) -> bool:
    """A usage line (``[--host H]``, ``...``, ``<a|b>``), not an example."""
    return any(t.startswith("[") or "..." in t or ("|" in t and not t.startswith(("-", "'"))) or t.startswith("{")
               for t in argv)


@functools.lru_cache(maxsize=1)
def _parser():
    from minimind_ray.cli import build_parser

    return build_parser()


def _parse(argv: List[str]):
    """The CLI's own parser on ``argv``; (args, None) or (None, argparse's message)."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return _parser().parse_args(argv), None
    except SystemExit as e:  # --help prints and exits 0: the command works
        return None, None if e.code == 0 and out.getvalue() else (err.getvalue().strip().splitlines() or ["?"])[-1]


def _stand_ins(cfg):
    """The config with the local files this machine lacks stood in for (data, weights, a tokenizer directory)."""
    from minimind_ray.fsio import is_uri

    def missing(p):
        return p and not is_uri(p) and not p.startswith("demo") and not any(c in p for c in "*?[") and \
            not os.path.exists(p)

    here = str(REPO / "README.md")
    d, t = cfg.data, cfg.train
    data = dataclasses.replace(d, train_path=["demo" if missing(p) else p for p in d.train_path],
                               tokenizer="builtin" if missing(d.tokenizer) and "/" in d.tokenizer else d.tokenizer)
    rl = {}
    for name in ("grpo", "ppo", "agent"):  # a reward model's directory
        section = getattr(t, name)
        rl[name] = dataclasses.replace(section, rewards=[dataclasses.replace(r, path=str(REPO) if missing(r.path) else
                                                                             r.path) for r in section.rewards])
    train = dataclasses.replace(t, init_from=here if missing(t.init_from) else t.init_from, **rl)
    return dataclasses.replace(cfg, data=data, train=train)


def _check_run_config(path: Optional[str], overrides: List[str]) -> None:
    from minimind_ray.config import load_config, validate

    validate(_stand_ins(load_config(path, overrides, check=False)))


def check(command: str, whole: bool = True) -> Optional[str]:
    """None when ``command`` works as written (as far as it can be run here), else why not, in one line."""
    from minimind_ray.config_checks import ConfigError

    argv = shlex.split(command, comments=True)
    if "--" in argv and argv[0] == "ray":  # `ray job submit ... -- python -m pipelines.<x> ...`: the job's command
        argv = argv[argv.index("--") + 1:]
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # MINIMIND_RAY_VERBOSE=1 minimind-ray ...
        argv = argv[1:]
    if _synopsis(argv):
        return None
    if argv[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
        return None if argv[1] in targets else f"make: no target {argv[1]!r}"
    if argv[0].endswith(("python", "python3")) and argv[1].startswith("bench/"):
        return _check_script(argv[1], argv[2:])
    if argv[0].endswith(("python", "python3")) and argv[2].startswith("tests."):  # python -m tests.soak.gpu_check
        return _check_script(argv[2].replace(".", "/") + ".py", argv[3:])
    if argv[0].endswith(("python", "python3")) and argv[2] == "pytest":
        return _check_pytest(argv[3:])
    if argv[0].endswith(("python", "python3")):  # python -m pipelines.<entry>: the verb its main() passes
        if "<" in argv[2]:  # pipelines.<stage>: any of them
            return None
        entry = REPO / (argv[2].replace(".", "/") + ".py")
        if not entry.exists():
            return f"{argv[2]}: no such entry point"
        if argv[2] == "pipelines.demo":
            return _check_script(str(entry.relative_to(REPO)), argv[3:])
        verb = re.search(r'main\(\["([\w-]+)"', entry.read_text())
        argv = ([verb.group(1)] if verb else []) + argv[3:]
    else:
        argv = argv[1:]
    args, error = _parse(argv)
    if error:  # an inline span may name a verb and the one flag the prose is about (`minimind-ray generate --seed`)
        return None if not whole and re.search(r"arguments are required|expected one argument", error) else error
    if args is None or not whole and len(argv) == 1:  # --help; a verb named in prose (`minimind-ray prepare`'s output)
        return None
    try:
        _check_config(args)
    except ConfigError as e:
        return f"config error: {e}"
    return None


def _check_config(args) -> None:
    """The config-parsing part of a verb that has one."""
    from minimind_ray.stages import STAGES

    if args.verb in STAGES:  # as cli._load: the verb's stage, the overrides, --fresh
        _check_run_config(args.config, [f"train.stage={args.verb}", *args.overrides,
                                        *(["resume=never"] if getattr(args, "fresh", False) else [])])
    elif args.verb == "prepare":
        _check_run_config(args.config, list(args.overrides))
    elif args.verb == "pipeline":  # as pipeline/run.py: each stage's recipe with the pipeline's overrides
        from minimind_ray.pipeline.config import kind_of, load_pipeline

        pipe = load_pipeline(args.config)
        trained = False
        for stage in pipe.steps:
            if stage.recipe:
                extra = [f"train.stage={kind_of(stage)}"] if kind_of(stage) in STAGES else []
                if kind_of(stage) in STAGES and stage.init_from != "none" and (trained or stage.init_from != "previous"):
                    extra.append("train.init_from=README.md")  # an earlier stage's checkpoint, at run time
                trained = trained or kind_of(stage) in STAGES
                _check_run_config(stage.recipe, [*pipe.overrides, *extra, *stage.overrides, *args.overrides])
    elif args.verb == "sweep":
        from minimind_ray.raytrain.sweep_config import load_sweep

        sweep = load_sweep(args.config, list(args.overrides))
        _check_run_config(sweep.recipe, list(sweep.overrides))


def _check_script(script: str, argv: List[str]) -> Optional[str]:
    """A script of the repository exists and knows every --flag the command gives it."""
    path = REPO / script
    if not path.exists():
        return f"{script}: no such file"
    known = {a.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
             and getattr(node.func, "attr", "") in ("add_argument", "addoption") for a in node.args
             if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    unknown = [t.split("=")[0] for t in argv if t.startswith("--") and t.split("=")[0] not in known | {"--help"}]
    return f"{script}: unrecognized arguments: {' '.join(unknown)}" if known and unknown else None


def _check_pytest(argv: List[str]) -> Optional[str]:
    """A pytest run of the docs names test files that exist, and only the options tests/soak/conftest.py adds
    (pytest's own flags are pytest's)."""
    for a in argv:
        if a.startswith("tests/") and not (REPO / a.split("::")[0]).exists():
            return f"{a}: no such file"
    soak = _check_script("tests/soak/conftest.py", [a for a in argv if a.startswith("--") and
                                                    re.match(r"--(chaos|soak|gguf|rl|gpu)-|--keep", a)])
    return soak and soak.replace("tests/soak/conftest.py: ", "pytest: ")


EXAMPLES = [(doc, line, cmd, whole) for doc in DOCS for line, cmd, whole in commands(doc.read_text())]


def test_the_docs_have_examples_of_every_kind():
    kinds = {c.split()[1] for _, _, c, _ in EXAMPLES}  # the verb, -m (an entry point), a bench script, a make target
    assert len(EXAMPLES) > 60 and {"pretrain", "eval", "serve", "export", "-m", "demo", "bench/bench_serve.py"} <= kinds


@pytest.mark.parametrize("doc,line,command,whole", EXAMPLES,
                         ids=[f"{d.relative_to(REPO)}:{n}" for d, n, _, _ in EXAMPLES])
def test_every_example_command_works_as_written(doc, line, command, whole, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' commands run from the repository's root, as they say
    assert check(command, whole) is None, f"{doc.relative_to(REPO)}:{line}: {command}\n  -> {check(command, whole)}"


@pytest.mark.parametrize("broken,expect", [
    ("minimind-ray pretrain --config pipelines/configs/tiny.yaml train.learning_rate=1e-3",
     "config error: train.learning_rate: no such field in train; did you mean train.lr?"),
    ("minimind-ray sft --config pipelines/configs/demo_sft.yaml data.format=pretrain",
     "config error: data.format: sft trains on sft records, not 'pretrain'"),
    ("python -m pipelines.dpo --config pipelines/configs/dpo_26m.yaml train.dpo.beta=0",
     "config error: train.dpo.beta: must be > 0"),
    ("minimind-ray pipeline --config pipelines/configs/no_such.yaml", "config error: config file not found"),
    (".venv/bin/minimind-ray eval runs/<run> --task mc --shotz 5", "unrecognized arguments: --shotz 5"),
    ("minimind-ray serve runs/<run> --replicaz 2", "unrecognized arguments: --replicaz 2"),
    ("python -m pipelines.pretrain --halp", "unrecognized arguments: --halp"),
    (".venv/bin/python bench/bench_serve.py --clients 16 --tokenz 8", "unrecognized arguments: --tokenz"),
    ("make demos", "make: no target 'demos'"),
    (".venv/bin/python -m pytest -m soak -s tests/soak/test_chaoz.py", "tests/soak/test_chaoz.py: no such file"),
    (".venv/bin/python -m pytest -m soak tests/soak/test_chaos_soak.py --soak-runz 3",
     "pytest: unrecognized arguments: --soak-runz"),
    ("python3 -m tests.soak.gpu_ray_check --cpux", "unrecognized arguments: --cpux"),
])
def test_a_broken_example_fails_naming_its_error(tmp_path, monkeypatch, broken, expect):
    monkeypatch.chdir(REPO)
    doc = tmp_path / "broken.md"
    doc.write_text(f"Intro.\n\n```bash\n{broken}   # as a doc would write it\n```\n")
    [(line, command, whole)] = list(commands(doc.read_text()))
    assert line == 4 and whole
    error = check(command, whole)
    assert error is not None and expect in error, error


def test_continued_lines_job_commands_and_inline_spans_are_extracted():
    text = ("Run `minimind-ray sweep --config pipelines/configs/sweep_tiny.yaml` or\n\n```bash\n"
            "ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\\n"
            "    python -m pipelines.pretrain --config pipelines/configs/tiny.yaml \\\n"
            "    data.train_path=/data/pretrain_hq.jsonl\n```\n")
    found = list(commands(text))
    assert [(n, whole) for n, _, whole in found] == [(4, True), (1, False)]
    assert found[0][1].startswith("ray job submit") and found[0][1].endswith("/data/pretrain_hq.jsonl")
    assert check(found[0][1]) is None  # one path where a list is (issue 38): the job's command as the docs write it
