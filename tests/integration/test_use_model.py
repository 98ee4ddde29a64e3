"""Using a trained model with no training code running: generate, chat, eval and export, through the CLI.

The checkpoint is written with the same functions the training loop uses (no Ray Train run needed);
Ray is only used to prepare the built-in data once.
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minimind_ray.config import load_config, to_dict
from minimind_ray.model.minimind import build_model
from minimind_ray.engine.state import RNGState
from minimind_ray.store import checkpoint as ckpt_io

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def cli(*args, stdin=None, timeout=240):
    p = subprocess.run([sys.executable, "-m", "minimind_ray.cli", *args], cwd=REPO, input=stdin, text=True,
                       capture_output=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    """A run directory holding one complete checkpoint of a tiny model, as the loop writes it."""
    from minimind_ray.data.prepare import ensure_prepared
    from minimind_ray.tokenizer import resolve_tokenizer

    base = tmp_path_factory.mktemp("use_model")
    cfg = load_config("pipelines/configs/tiny.yaml", [f"data.cache_dir={base / 'cache'}", "data.format=sft",
                                                      "train.stage=sft", "data.eval_fraction=0.05"])
    tok = resolve_tokenizer(cfg.data.tokenizer, cfg.data.cache_dir)
    prepared = ensure_prepared(cfg.data, tok)
    model = build_model(cfg.model, seed=5)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck = base / "runs" / "demo-run" / "checkpoint_000001"
    ckpt_io.write_rank_files(ck, 0, RNGState().state_dict())
    ckpt_io.write_shared_files(ck, model_state=model.state_dict(),
                               train_state={"optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                               meta=ckpt_io.CheckpointMeta(step=1, epoch=0, data_state={}, world_size=1, stage="sft",
                                                           total_steps=1, config=to_dict(cfg), prepared_dir=prepared))
    return {"run_dir": ck.parent, "ckpt": ck, "cfg": cfg, "model": model, "prepared": prepared, "base": base}


def test_greedy_generation_is_deterministic_from_a_run_directory(trained):
    # a plain continuation: the untrained model's first chat-template token may be <|im_end|> (an empty reply)
    args = ["generate", "--weights", str(trained["run_dir"]), "--prompt", "The capital of France", "--raw",
            "--temperature", "0", "--max-new-tokens", "12"]
    a, b = cli(*args), cli(*args)
    assert a == b and a.strip()


def test_chat_streams_replies_and_quits_on_an_empty_line(trained):
    # lines after the empty one are never read: a chat that only stopped at the end of its input would
    # answer them too
    out = cli("chat", "--weights", str(trained["ckpt"]), "--temperature", "0", "--max-new-tokens", "8",
              stdin="hello\nand again\n\nnot read\nnor this\n")
    assert out.count("minimind> ") == 2 and out.count("you> ") == 3, out


def test_ctrl_c_in_a_verb_is_one_line_and_exit_130(trained):
    """Ctrl-C where no clean stop is planned (here chat, waiting for its user) is one line naming the verb, exit 130,
    never Python's KeyboardInterrupt traceback."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "minimind_ray.cli", "chat", "--weights", str(trained["ckpt"])],
                         cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    while not seen.endswith("you> "):  # the prompt: it waits on its input now
        char = p.stdout.read(1)
        assert char, (p.wait(), seen, p.stderr.read()[-3000:])
        seen += char
    p.send_signal(signal.SIGINT)
    code, err = p.wait(timeout=60), p.stderr.read()
    assert code == 130 and err.strip().splitlines()[-1] == ("interrupted: minimind-ray chat stopped before it ended "
                                                            "(--debug shows where)"), (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]


def test_eval_loss_equals_the_training_loss_in_eval_mode(trained):
    import json

    from minimind_ray.data.stream import PreparedDataset, TrainStream

    res = json.loads(cli("eval", "--weights", str(trained["run_dir"]), "--micro-batch-size", "4"))
    # the same held-out batches, loss computed by hand: token-mean CE over targets, eval mode
    ds = PreparedDataset(trained["prepared"], eval_fraction=trained["cfg"].data.eval_fraction)
    stream = TrainStream(ds, split="eval", global_batch_size=4, micro_batch_size=4, world_size=1, rank=0, seed=0,
                         shuffle=False, prefetch_steps=0)
    model = trained["model"].eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for mb in stream.eval_batches():
            logits = model(mb["input_ids"]).logits
            total += F.cross_entropy(logits.flatten(0, 1), mb["targets"].flatten(), ignore_index=-100,
                                     reduction="sum").item()
            n += int(mb["targets"].ne(-100).sum())
    stream.close()
    assert n > 0 and res["eval_units"] == n
    assert res["eval_loss"] == pytest.approx(total / n, rel=1e-5)
    assert res["eval_ppl"] == pytest.approx(math.exp(total / n), rel=1e-5)


def test_export_from_a_run_directory_gives_minimind_pth_and_an_hf_folder(trained, tmp_path):
    out = cli("export", str(trained["run_dir"]), "--out", str(tmp_path / "export"))
    pth = next((tmp_path / "export").glob("full_sft_*.pth"))
    sd = torch.load(pth, weights_only=True)
    assert all(v.dtype == torch.float16 for v in sd.values())
    fresh = build_model(trained["cfg"].model)
    fresh.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    hf = tmp_path / "export" / "hf"
    assert (hf / "config.json").exists() and (hf / "model.safetensors").exists() and (hf / "tokenizer.json").exists()
    assert "hf:" in out


@pytest.mark.parametrize("preset,generation", [("tiny", "minimind2"), ("tiny3", "minimind3")])
def test_a_bare_minimind_pth_loads_with_minimind_tokenizers(preset, generation, tmp_path):
    """A MiniMind-style fp16 .pth with no run around it: the architecture is inferred from its shapes,
    MiniMind's own tokenizer renders the chat (minimind-3 with its thinking switch)."""
    from minimind_ray.config import ModelConfig
    from minimind_ray.store.pth import save_pth
    from minimind_ray.model.presets import preset_values
    from tests.conftest import minimind_tokenizer_dir

    tok = minimind_tokenizer_dir(generation)
    pth = tmp_path / "pretrain_64.pth"
    save_pth(build_model(ModelConfig(**preset_values(preset)), seed=1), str(pth))
    extra = ["--think"] if generation == "minimind3" else []
    out = cli("generate", "--weights", str(pth), "--tokenizer", str(tok), "--prompt", "你好", "--temperature", "0",
              "--max-new-tokens", "6", *extra)
    # the CLI inferred the preset and used the tokenizer's template: same text as generating in-process
    from minimind_ray.generate import generate_text
    from minimind_ray.model.sampling import SamplingParams
    from minimind_ray.tokenizer import load_tokenizer
    from minimind_ray.store.weights import build_inference_model

    model, lw = build_inference_model(str(pth))
    assert lw.model_cfg.preset == preset
    want = generate_text(model, load_tokenizer(str(tok)), "你好", SamplingParams(max_new_tokens=6, temperature=0.0),
                         think=True if extra else None)
    assert out == want + "\n"
