"""Options of the checks in tests/soak/ (marker ``soak``: never in ``make test``; ``make soak`` runs them).

Give them after a path inside tests/soak/, which makes pytest read this file before it parses the command line:
``pytest -m soak -s tests/soak/test_chaos_soak.py --soak-runs 20``."""
from __future__ import annotations


def pytest_addoption(parser):
    g = parser.getgroup("soak", "tests/soak/ (marker soak)")
    g.addoption("--chaos-events", default=None,
                help="test_chaos.py: comma list, in order: kind:rank faults (kind:rank@step at that step), mlflow, "
                     "driver, node (default: ten, every kind)")
    g.addoption("--chaos-steps", type=int, default=0,
                help="test_chaos.py: training steps (default: what the events need)")
    g.addoption("--chaos-no-twin", action="store_true", help="test_chaos.py: no uninterrupted twin (no weight check)")
    g.addoption("--soak-runs", type=int, default=20, help="test_chaos_soak.py: runs, each with 1-3 SIGKILLs")
    g.addoption("--soak-seed", type=int, default=0, help="test_chaos_soak.py: the kills' plan (count, delays)")
    g.addoption("--soak-steps", type=int, default=40, help="test_chaos_soak.py: steps of each run")
    g.addoption("--keep", action="store_true", help="test_chaos*.py: keep the work directory (runs, logs, results)")
    g.addoption("--gguf-weights", default=None,
                help="test_gguf.py: a run dir, checkpoint or .pth (default: fresh models of each GGUF layout)")
    g.addoption("--gguf-tokenizer", default=None, help="test_gguf.py: tokenizer name or dir (default: the run's)")
    g.addoption("--gguf-tokens", type=int, default=24, help="test_gguf.py: greedy tokens per prompt")
    g.addoption("--rl-seeds", type=int, default=5, help="test_rl_margins.py: seeds per stage")
    g.addoption("--gpu-out", default=None, help="test_gpu.py: where the Ray GPU check writes (default: a temp dir)")
