"""The CLI on bad input (issue 11, items 11, 14, 15), run as a user runs it: ``python -m minimind_ray.cli``
in a subprocess. Every refusal is exit code 2 with one stderr line naming the input, nothing written or
deleted; ``--debug`` (before the verb) shows the traceback instead. Needs no Ray: each refusal comes first.
The other items' CLI refusals call ``cli.main`` in-process (tests/unit/test_cli_main.py): a subprocess
costs seconds of imports each."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from minimind_ray.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store.pth import save_pth
from tests.conftest import minimind_tokenizer_dir

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "minimind_ray.cli", *map(str, args)], cwd=cwd, text=True,
                          capture_output=True, timeout=300)


def refused(*args, cwd=REPO) -> str:
    """Run a verb that must be refused: exit code 2 and one line on stderr, which is returned."""
    p = cli(*args, cwd=cwd)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_weights")
    ours = build_model(ModelConfig(**preset_values("tiny")), seed=3)
    save_pth(ours, str(d / "tiny.pth"))
    data = (d / "tiny.pth").read_bytes()
    (d / "cut.pth").write_bytes(data[: len(data) // 2])
    return d


def test_item11_a_recipe_that_is_not_yaml_exits_2_naming_file_line_and_column(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  preset: tiny\n  hidden_size: [64\ntrain:\n  lr: 1.0e-3\n")
    line = refused("pretrain", "--config", recipe, "data.train_path=[demo]")
    assert line.startswith(f"config error: {recipe}:4:6: invalid YAML: "), line


def test_item14_a_truncated_pth_exits_2_naming_it_and_debug_shows_the_traceback(weights):
    tok = minimind_tokenizer_dir("minimind2")
    args = ["generate", "--weights", weights / "cut.pth", "--prompt", "hi", "--tokenizer", tok]
    line = refused(*args)
    assert line.startswith(f"error: {weights / 'cut.pth'}: not a readable PyTorch .pth (RuntimeError: "), line
    p = cli("--debug", *args)
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr and "WeightsError" in p.stderr


def test_item15_an_unknown_export_format_exits_2_and_writes_nothing(weights, tmp_path):
    out = tmp_path / "export"
    line = refused("export", weights / "tiny.pth", "--out", out, "--format", "minimnd")
    assert line == "error: export format(s) ['minimnd'] unknown; choose from minimind, hf, safetensors, gguf"
    assert not out.exists()
