"""The CLI on bad input (issue 11, items 11, 14, 15; issue 47's mistakes a config or file decides), run as a user
runs it: ``python -m minimind_ray.cli`` in a subprocess. Every refusal is exit code 2 with one stderr line naming the
input, nothing written or deleted; ``--debug`` (before the verb) shows the traceback instead. Needs no Ray: each
refusal comes first (a training verb's refusal prints nothing on stdout: not even the run's start line, which comes
before Ray starts).
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


def cli(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "minimind_ray.cli", *map(str, args)], cwd=cwd, text=True,
                          capture_output=True, timeout=300, env=env)


def refused(*args, cwd=REPO, env=None) -> str:
    """Run a verb that must be refused: exit code 2 and one line on stderr, which is returned."""
    p = cli(*args, cwd=cwd, env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    if args and args[0] in ("pretrain", "sft", "dpo"):  # refused before the run's start line: before Ray
        assert p.stdout == "", p.stdout[-2000:]
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


# --------------------------------------------------------------------------- issue 47: decided before Ray starts


FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_v1"


def train(tmp_path, verb, *overrides, env=None) -> str:
    """A training verb on the tiny recipe with everything written under ``tmp_path``, which must be refused."""
    return refused(verb, "--config", REPO / "pipelines/configs/tiny.yaml", f"checkpoint.storage_path={tmp_path}/runs",
                   f"data.cache_dir={tmp_path}/cache", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides,
                   cwd=tmp_path, env=env)


def test_init_from_of_another_architecture_is_refused_naming_both(tmp_path):
    ckpt = FIXTURE / "checkpoint_step4"  # hidden 32, 2 layers, vocab 320; the recipe writes model.preset: tiny
    line = train(tmp_path, "sft", "data.format=sft", "data.train_path=[demo]", f"train.init_from={ckpt}")
    assert line.startswith(f"config error: train.init_from: {ckpt} is tiny (hidden 32, 2 layers, 2 heads, vocab 320), "
                           f"a checkpoint at step 4; this run asks tiny (hidden 64, 2 layers, 4 heads, vocab 6400)"), line
    assert line.endswith("drop model.preset to train the weights' own architecture, or make them equal"), line


def test_init_from_without_a_complete_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    line = train(tmp_path, "sft", "data.format=sft", "data.train_path=[demo]", f"train.init_from={tmp_path / 'empty'}")
    assert line == (f"config error: train.init_from: {tmp_path / 'empty'}: no complete checkpoint_* directory, no HF "
                    f"export (config.json + model.safetensors) and not a .pth or .safetensors file")


def test_more_workers_than_a_local_ray_holds_are_refused_naming_the_field_and_what_fits(tmp_path):
    import os

    most = 2 * os.cpu_count()
    line = train(tmp_path, "pretrain", "cluster.num_workers=64", "train.global_batch_size=64",
                 "train.micro_batch_size=1")
    assert line.startswith(f"config error: cluster.num_workers: 64 training workers of 1 thread(s) on a local Ray "
                           f"with {os.cpu_count()} core(s); at most {most} fit"), line
    assert "cluster.check_local_fit=false" in line


def test_a_tokenizer_that_cannot_be_fetched_is_said_before_ray(tmp_path):
    import os

    env = {**os.environ, "MINIMIND_RAY_TOKENIZER_MIRROR": str(tmp_path / "no-mirror"),
           "MINIMIND_RAY_CACHE_DIR": str(tmp_path / "cache-home")}
    line = train(tmp_path, "pretrain", "data.tokenizer=minimind2", env=env)
    assert line.startswith("error: tokenizer 'minimind2': cannot fetch "), line
    assert "MINIMIND_RAY_TOKENIZER_MIRROR" in line


def test_a_data_file_of_another_format_is_refused_with_its_counts(tmp_path):
    texts = tmp_path / "pretrain.jsonl"
    texts.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(20)))
    line = train(tmp_path, "sft", "data.format=sft", f"data.train_path={texts}")
    assert line == (f"config error: data.train_path: {texts}: none of its first 20 records is a sft record "
                    f"(data.format=sft, the sft verb's) (missing_field: 20; line 1: field 'conversations' missing); "
                    f"they read as pretrain records (data.format=pretrain, or the verb that trains on them)")
