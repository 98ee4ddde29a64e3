"""``cli.main`` in-process (issue 11, items 12-14, 16, 17, 19): bad input is exit code 2 and one stderr line
naming the input, for every user verb, and the project's exports load back in its own verbs. The subprocess
checks (a real exit, ``--debug`` tracebacks) are tests/integration/test_cli_errors.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from minimind_ray.cli import main
from minimind_ray.config import ModelConfig
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store.pth import save_pth
from tests.conftest import cli_stderr

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v1"


def refused(capsys, *args) -> str:
    code = main([str(a) for a in args])
    lines = cli_stderr(capsys).splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_main")
    ours = build_model(ModelConfig(**preset_values("tiny")), seed=3)
    save_pth(ours, str(d / "tiny.pth"))
    torch.save({k: (v * 100).to(torch.int8) for k, v in ours.state_dict().items()}, d / "int8.pth")
    return d


def test_item12_13_bad_values_exit_2_and_prepare_leaves_no_files(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert refused(capsys, "pretrain", "data.train_path=[demo]", "model.num_attention_heads=0") == \
        "config error: model.num_attention_heads: must be >= 1, got 0"
    out = tmp_path / "prepared"
    line = refused(capsys, "prepare", "--out", out, "data.train_path=[demo]", "data.block_rows=0")
    assert line == "config error: data.block_rows: must be >= 1, got 0"
    assert not any(tmp_path.iterdir())  # no prepared dir, no part-*.tmp, no tokenizer cache: nothing ran


def test_item14_an_unknown_preset_and_a_missing_tokenizer_exit_2_naming_them(capsys, weights):
    line = refused(capsys, "generate", "--weights", weights / "tiny.pth", "--preset", "tiny4", "--prompt", "hi")
    assert line.startswith("error: preset: unknown preset 'tiny4'; known: "), line
    line = refused(capsys, "generate", "--weights", weights / "tiny.pth", "--prompt", "hi")  # was SystemExit, exit 1
    assert line.startswith(f"error: {weights / 'tiny.pth'}: --tokenizer is needed"), line
    line = refused(capsys, "chat", "--weights", weights / "nothing.pth")
    assert line == f"error: {weights / 'nothing.pth'}: no such file or directory"


def test_item14_merge_lora_with_a_file_that_has_no_adapters_exits_2(capsys, weights, tmp_path):
    line = refused(capsys, "merge-lora", "--base", weights / "tiny.pth", "--lora", weights / "tiny.pth",
                   "--out", tmp_path / "merged.pth")  # was a StopIteration traceback
    assert line.startswith(f"error: --lora {weights / 'tiny.pth'}: no '<module>.lora.A.weight' keys"), line
    assert not (tmp_path / "merged.pth").exists()


def test_item14_debug_reraises_with_the_traceback(weights):
    with pytest.raises(ValueError, match="unknown preset 'tiny4'"):
        main(["--debug", "generate", "--weights", str(weights / "tiny.pth"), "--preset", "tiny4", "--prompt", "hi"])


def test_item17_int8_weights_exit_2_naming_tensor_and_dtype(capsys, weights, tmp_path):
    line = refused(capsys, "export", weights / "int8.pth", "--out", tmp_path / "x", "--format", "minimind")
    assert line.startswith(f"error: {weights / 'int8.pth'}: tensor 'model.embed_tokens.weight' has dtype int8"), line
    assert not (tmp_path / "x").exists()


def test_item19_eval_on_data_of_another_tokenizer_exits_2(capsys, weights, tmp_path):
    """tiny.pth with MiniMind's tokenizer named, on data prepared with the fixture's 300-token BPE."""
    from tests.conftest import minimind_tokenizer_dir

    prepared = tmp_path / "prepared"
    shutil.copytree(FIXTURE / "prepared", prepared)
    line = refused(capsys, "eval", "--weights", weights / "tiny.pth", "--data", prepared, "--tokenizer",
                   minimind_tokenizer_dir("minimind2"))
    assert line.startswith(f"error: prepared data {prepared} was tokenized with tokenizer hash 258bbd64"), line
    with pytest.raises(SystemExit) as e:  # argparse's own refusal: exit 2, naming the option
        main(["eval", "--weights", str(weights / "tiny.pth"), "--data", str(prepared), "--micro-batch-size", "0"])
    assert e.value.code == 2 and "argument --micro-batch-size: must be >= 1, got 0" in capsys.readouterr().err


def test_item16_the_projects_exports_load_back_in_its_own_verbs(capsys, weights, tmp_path):
    from tests.conftest import minimind_tokenizer_dir

    tok = minimind_tokenizer_dir("minimind2")
    out = tmp_path / "export"
    assert main(["export", str(weights / "tiny.pth"), "--out", str(out), "--format", "safetensors, hf",
                 "--tokenizer", str(tok)]) == 0
    capsys.readouterr()
    gen = ["--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "6", "--raw"]
    texts = []
    for source, extra in ((weights / "tiny.pth", ["--tokenizer", str(tok)]),
                          (out / "model.safetensors", ["--tokenizer", str(tok)]),
                          (out / "hf", [])):  # the HF folder brings its own tokenizer
        assert main(["generate", "--weights", str(source), *extra, *gen]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and texts[0].strip()  # the same fp16 weights: the same greedy text


def test_generate_and_chat_take_the_weights_positionally_or_as_the_flag_but_once(capsys, weights):
    """Issue 47: `generate RUN` / `chat RUN` as `eval`, `serve` and `export` take it; `--weights` still works; both
    or neither is one line, exit 2, before any weights are read."""
    from tests.conftest import minimind_tokenizer_dir

    tok = str(minimind_tokenizer_dir("minimind2"))
    gen = ["--tokenizer", tok, "--prompt", "The capital of France is", "--temperature", "0", "--max-new-tokens", "4",
           "--raw"]
    texts = []
    for where in (["generate", str(weights / "tiny.pth")], ["generate", "--weights", str(weights / "tiny.pth")]):
        assert main(where + gen) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    for verb, extra in (("generate", ["--prompt", "hi"]), ("chat", [])):
        line = refused(capsys, verb, weights / "nothing.pth", "--weights", weights / "other.pth", *extra)
        assert line == f"error: {verb}: the weights twice ({weights / 'nothing.pth'} and --weights " \
                       f"{weights / 'other.pth'}): give WEIGHTS or --weights, not both", line
        line = refused(capsys, verb, *extra)
        assert line == f"error: {verb}: which weights? give WEIGHTS (a run dir, checkpoint, .pth, HF folder or " \
                       f"storage URI), or --weights", line
        line = refused(capsys, verb, weights / "nothing.pth", *extra)  # positional, read as the flag was
        assert line == f"error: {weights / 'nothing.pth'}: no such file or directory"
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        usage = " ".join(capsys.readouterr().out.split())
        assert e.value.code == 0 and f"usage: minimind-ray {verb} [-h] [--weights WEIGHTS]" in usage, usage
        assert "WEIGHTS .pth, checkpoint dir, run dir, HF folder or storage URI" in usage
        assert "--weights WEIGHTS the same as WEIGHTS (the older spelling)" in usage
