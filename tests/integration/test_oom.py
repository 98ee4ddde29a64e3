"""Out of memory, said plainly (issue 25, part 5): real memory failures through the real CLI and Ray.

- Training: a micro-batch whose logits are twice the machine's memory (its vocabulary sized from the machine's
  memory, so that it runs on any machine the fixture's 982 sequences serve). The host refuses the allocation
  (a real ``DefaultCPUAllocator`` failure in the worker, nothing touched), the Train controller ends the
  run at the first failure instead of restarting it ``cluster.max_failures`` times, and ``main`` prints
  one line naming the settings, exit 2. It runs in this process on the session's Ray (no Ray to start).
- Prepare: ``minimind-ray prepare`` under ``RAY_memory_usage_threshold=0.02`` in a subprocess with its own
  Ray, so Ray's memory monitor kills every prepare task; the retries are bounded (2, then one line, exit 2)
  where Ray's default retried them without end.
Tests of the estimate and of the messages' figures are in tests/unit/test_memory_estimate.py.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _RAY_FORWARDED

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests/fixtures/checkpoint_v1"  # 982 prepared sequences of 32 tokens, its own tokenizer
VOCAB = 1 << 20  # logits of 32 tokens x 2^20 vocab x 4 bytes = 128 MiB per sequence (the vocabulary doubles on large machines)
MAX_MICRO = 512  # of the fixture's 982 sequences


def _machine_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemTotal"] + info.get("SwapTotal", 0)


def refusing_batch(machine_bytes: int) -> tuple:
    """(micro-batch, vocabulary): logits of the micro-batch alone are twice RAM + swap; the vocabulary doubles from
    2^20 until the micro-batch is at most MAX_MICRO sequences (on a machine of more than 64 GiB)."""
    vocab = VOCAB
    while math.ceil(2 * machine_bytes / (32 * vocab * 4)) > MAX_MICRO:
        vocab *= 2
    return math.ceil(2 * machine_bytes / (32 * vocab * 4)), vocab


def test_the_refused_allocation_is_sized_from_the_machine():
    GiB = 1 << 30
    assert refusing_batch(24 * GiB) == (384, VOCAB)  # the CI machine's 24 GiB: 384 sequences of 128 MiB
    for machine in (64 * GiB, 141 * GiB, 2048 * GiB):  # the GPU machine has 128 GiB + swap
        micro, vocab = refusing_batch(machine)
        assert micro <= MAX_MICRO and 32 * vocab * 4 * micro >= 2 * machine and vocab > VOCAB


def _refusing_micro_batch() -> tuple:
    """A micro-batch whose logits alone are twice RAM + swap: the kernel refuses it at once (unless it
    overcommits everything, vm.overcommit_memory=1, when the test cannot run safely: an allowed skip,
    tests/skip_budget.py)."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory=1 would grant the allocation and then touch it")
    return refusing_batch(_machine_bytes())


def test_a_micro_batch_the_host_cannot_hold_ends_the_run_at_once_in_one_line(ray_session, tmp_path, capsys,
                                                                            fresh_name):
    from minimind_ray.cli import main
    from minimind_ray.engine.memory import estimate
    from minimind_ray.config import load_config

    micro, vocab = _refusing_micro_batch()
    over = ["model.preset=tiny", "model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=64", f"model.vocab_size={vocab}",
            f"data.train_path=[{FIXTURE / 'prepared'}]", f"data.tokenizer={FIXTURE / 'tokenizer'}",
            "data.max_seq_len=32", "data.block_rows=16", "data.shuffle_window_blocks=2",
            f"train.global_batch_size={micro}", f"train.micro_batch_size={micro}", "train.max_steps=2",
            "cluster.num_workers=1", "cluster.max_failures=3", "tracking.enabled=false",
            f"checkpoint.storage_path={tmp_path / 'runs'}", f"name={fresh_name}"]
    capsys.readouterr()
    assert main(["pretrain", *over]) == 2
    out, err = capsys.readouterr()
    ours = cli_stderr_lines(err)
    assert len(ours) == 1, err[-4000:]
    line = ours[0]
    assert line.startswith("error: out of memory on the host, rank 0: the host refused an allocation of "), line
    assert "train.micro_batch_size=" in line and "data.max_seq_len" in line and "Not retried" in line, line
    suggested = int(re.search(r"train\.micro_batch_size=(\d+)", line).group(1))
    cfg = load_config(None, over)
    assert micro % suggested == 0 and estimate(cfg, suggested).total < estimate(cfg).total / 4, line
    # said before the workers started, by the estimate
    assert "[minimind-ray] WARNING: memory: one worker needs about" in out, out[-3000:]
    # the worker group started once: no restart met the same allocation again (max_failures=3)
    assert out.count("[minimind-ray] world 1 on cpu") == 1, out[-3000:]
    assert len(list((tmp_path / "runs" / fresh_name / ".faults").glob("detected-*.json"))) == 1
    # no traceback from the worker, the controller or the driver (Ray's own daemons may log theirs)
    ours_and_train = [ln for ln in (out + err).splitlines()
                      if "PlacementGroupCleaner" not in ln and "Traceback" in ln]
    assert not ours_and_train, (out + err)[-4000:]


def cli_stderr_lines(err: str):
    """stderr without Ray's forwarded worker lines and without Ray's own timestamped log records."""
    return [ln for ln in err.splitlines()
            if ln.strip() and not _RAY_FORWARDED.match(ln) and not re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d", ln)]


def test_prepare_under_memory_pressure_fails_after_two_retries_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_task_oom_retries")}
    env["RAY_memory_usage_threshold"] = "0.02"  # every running task is over it: the monitor kills each one
    env["RAY_task_oom_retry_delay_base_ms"] = "0"  # Ray's wait before each retry (1 s, doubling): not what is tested
    out_dir = tmp_path / "prepared"
    p = subprocess.run([sys.executable, "-m", "minimind_ray.cli", "prepare", "--config", "pipelines/configs/tiny.yaml",
                        f"data.tokenizer={FIXTURE / 'tokenizer'}", "--out", str(out_dir)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    both = p.stdout + p.stderr
    assert p.returncode == 2, both[-4000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory while preparing "), last
    assert "Ray's memory monitor killed" in last and "GiB of its" in last and "after 2 retries" in last, last
    assert "data.block_rows=64" in last and "data.chunk_bytes=" in last, last
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [last]
    assert "Traceback" not in both, both[-4000:]
    # bounded: Ray retried twice and said so; its default would have said "infinite oom retries remaining"
    assert both.count("oom retries remaining") == 2 and "infinite oom retries" not in both, both[-4000:]
    assert not list(out_dir.rglob("manifest.json"))  # nothing half-prepared passes for prepared
