"""The memory estimate (engine/memory.py) against measured peaks, the micro-batch it suggests, and the
reading of out-of-memory messages (memory_errors.py). No Ray.

The measured side is ``peak_mem_gb``, the metric the engine's loop reports (peak RSS on CPU), of a fresh
process that trains a few steps on the fixture's prepared data (sequences of 32 tokens), so that nothing
earlier in the test session counts in its peak.

That process is not a Ray worker: what it holds before its first tensor (torch's and the engine's pages, ~0.25-0.35
GiB, part of it shared-library pages whose count in RSS varies with what the page cache holds, so with what else
runs on the machine) is less than the 0.5 GiB the estimate allows a Ray Train worker. So the estimate is held
against what training added to the peak (the peak less the process's own runtime, measured in it) on top of the
runtime it allows, and that allowance against the measured runtime. (Held against the raw peak, the ratios were
1.14-1.18 here beside other processes, and the test failed 1 run in 2 under pytest-xdist.)

Under FSDP (train.parallelism=fsdp) each case is two ranks over gloo, two children forked side by side, and each rank's
peak is held against the per-worker estimate at world 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minimind_ray.config import load_config
from minimind_ray.engine.memory import GiB, advice, estimate, suggest_micro_batch
from minimind_ray.memory_errors import read_oom

REPO = Path(__file__).resolve().parents[2]

CASES = [("tiny", 256, 1), ("minimind2-small", 16, 1), ("tiny", 256, 2), ("minimind2-small", 16, 2)]  # world 2: FSDP
# One process imports torch and the engine once, then forks a child per case (per rank): each child's peak RSS starts
# from the same imported process, as a fresh worker's would, and no case sees another's memory.
MEASURE = r"""
import dataclasses, json, os, sys, tempfile
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict, torch.distributed.fsdp  # what the engine imports when it shards


def status_gib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20  # kB -> GiB
from minimind_ray.config import ModelConfig
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.memory import estimate
from minimind_ray.model.presets import preset_values
from tests.unit.test_engine import PREPARED, fixture_config


def measure(preset, micro, world, rank, init):
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cfg = fixture_config(max_steps=2, micro_batch_size=micro, global_batch_size=world * micro, precision="fp32",
                         log_interval=1, threads_per_worker=1, parallelism="fsdp" if world > 1 else "ddp")
    cfg = dataclasses.replace(cfg, model=ModelConfig(**preset_values(preset)),
                              cluster=dataclasses.replace(cfg.cluster, num_workers=world))
    anon_at_start = status_gib("RssAnon")  # the imported process's own heap, copied at fork
    peaks = []

    class Peak(Hooks):
        def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
            peaks.append(metrics["peak_mem_gb"])

    run(TrainState.build(cfg, PREPARED, rank, world), Peak())
    e = estimate(cfg, micro, "cpu", world)
    # the code and library pages training touched (mapped files: no tensor lives there)
    runtime = anon_at_start + status_gib("RssFile")
    return {"preset": preset, "micro": micro, "world": world, "measured_gib": max(peaks), "runtime_gib": runtime,
            "estimate_gib": e.total / 2**30, "runtime_estimate_gib": e.parts["runtime"] / 2**30,
            "parts": {k: round(v / 2**30, 3) for k, v in e.parts.items()}}


for preset, micro, world in json.loads(sys.argv[1]):
    init, children = tempfile.mktemp(prefix="mmr-gloo-"), []
    for rank in range(world):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, json.dumps(measure(preset, micro, world, rank, init)).encode())
            os._exit(0)
        os.close(w)
        children.append((pid, r))
    for pid, r in children:
        with os.fdopen(r) as f:
            out = f.read()
        assert os.waitpid(pid, 0)[1] == 0, (preset, micro, world)
        print(out, flush=True)
"""


def test_the_estimate_is_within_15_percent_of_the_measured_cpu_peak_less_the_process_runtime():
    """tiny at 256 x 32 tokens: the logits dominate (vocab 6400, hidden 64); minimind2-small at 16 x 32:
    weights, gradients and AdamW dominate (25.8M parameters). Each on one process (DDP's estimate) and on two FSDP
    ranks (FSDP's: the shards, the gathered blocks, the heap's slack)."""
    p = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(CASES)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(line) for line in p.stdout.strip().splitlines() if line.startswith("{")]
    assert [(r["preset"], r["micro"], r["world"]) for r in results] == [c for c in CASES for _ in range(c[2])]
    for r in results:
        trained = r["measured_gib"] - r["runtime_gib"]
        print(f"{r['preset']} micro {r['micro']} x 32, world {r['world']}: measured {r['measured_gib']:.3f} GiB ({r['runtime_gib']:.3f} "
              f"the process's own), estimate {r['estimate_gib']:.3f} GiB {r['parts']}, ratio "
              f"{r['estimate_gib'] / (trained + r['runtime_estimate_gib']):.3f}")
        assert 0.85 < r["estimate_gib"] / (trained + r["runtime_estimate_gib"]) < 1.15, r
        # the allowance covers a bare process (a Ray worker holds more: ~0.45 GiB, engine/memory.py)
        assert 0.15 < r["runtime_gib"] < r["runtime_estimate_gib"], r


def _cfg(*over):
    return load_config("pipelines/configs/pretrain_26m.yaml",
                       ["data.train_path=[demo]", "cluster.use_gpu=false", *over])


def test_the_estimate_grows_with_the_micro_batch_and_counts_what_each_stage_adds():
    cfg = _cfg()
    small, big = estimate(cfg, 8), estimate(cfg, 16)
    fixed = ("parameters", "gradients", "AdamW", "runtime")
    assert all(small.parts[k] == big.parts[k] for k in fixed)
    assert big.parts["activations"] == 2 * small.parts["activations"] and big.parts["logits"] == 2 * small.parts["logits"]
    # the seed's recipe on one CPU worker: 128 x 512 tokens is about 30 GiB, more than a 24 GiB machine has
    assert 25 * GiB < estimate(cfg).total < 35 * GiB
    # bf16 on a GPU saves activation bytes; DPO runs chosen + rejected and holds a reference copy
    assert estimate(cfg, device_type="cuda").parts["activations"] < estimate(cfg).parts["activations"]
    dpo = estimate(_cfg("train.stage=dpo", "data.format=dpo"), 8)
    assert dpo.sequences == 16 and dpo.parts["parameters"] == 2 * small.parts["parameters"]
    lora = estimate(_cfg("train.stage=lora", "data.format=sft"), 8)
    assert lora.parts["AdamW"] < small.parts["AdamW"] / 50  # only the adapters train


def test_the_suggested_micro_batch_fits_the_budget_and_keeps_the_global_batch():
    cfg = _cfg("cluster.num_workers=2")  # global 512 over 2 workers: a micro-batch must divide 256
    budget = estimate(cfg, 40).total
    m = suggest_micro_batch(cfg, 2, budget)
    assert m == 32 and 256 % m == 0 and estimate(cfg, m).total <= 0.9 * budget
    assert "train.micro_batch_size=32 (the global batch of 512 stays, by accumulation 8)" in advice(cfg, 2, budget, "cpu")
    # when the estimate says the current one fits (it was wrong this time), halve it
    assert suggest_micro_batch(cfg, 2, 1000 * GiB) == 64
    # when not even one sequence fits, say what else to change
    assert suggest_micro_batch(cfg, 2, 0.1 * GiB) is None
    assert "even train.micro_batch_size=1 needs about" in advice(cfg, 2, 0.1 * GiB, "cpu")
    grpo = load_config("pipelines/configs/demo_grpo.yaml", ["cluster.num_workers=1",
                                                             f"train.init_from={REPO / 'tests/fixtures/checkpoint_v1'}"])
    assert "train.grpo.num_generations" in advice(grpo, 1, estimate(grpo).total / 2, "cpu")


# Ray 2.58's memory-monitor message, as it reached the driver in this project (a prepare task killed).
RAY_OOM = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: "
    "a940c8f37ce067f23ada807f8) was 7.10GB / 23.54GB (0.301634)\nOOM kill reason: Memory usage 7625007104B exceeded "
    "threshold of 505530016B (2.0% of 25276502016B total)\nRay killed 1 worker(s) based on the killing policy\n"
    "Considered workers: [\nSelected to kill: (Task: job ID=01000000, lease ID=02000000, task name=Map(_run_task), "
    "required resources={CPU: 1}, pid=7555, actual memory used=0.06GB, worker ID=7c8483d3)\n]")
# Ray 2.60's: "used" and "limit" where 2.58 said nothing and "total"
RAY_OOM_2_60 = RAY_OOM.replace("was 7.10GB / 23.54GB", "was 7.10GB used / 23.54GB limit").replace(
    "25276502016B total", "25276502016B limit")
# torch's CUDA allocator message (c10/cuda/CUDACachingAllocator.cpp), as MiniMind's users report it.
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use. Of the "
            "allocated memory 76.20 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated.")


def test_out_of_memory_messages_are_read_in_figures():
    seen = read_oom(RAY_OOM)
    assert (seen.where, seen.source, seen.victim) == ("host", "memory monitor", "Map(_run_task)")
    assert seen.used == pytest.approx(7.10 * GiB) and seen.total == 25276502016 and seen.limit == 505530016
    assert seen.process == pytest.approx(0.06 * GiB)
    assert seen.describe() == ("Ray's memory monitor killed Map(_run_task) (0.1 GiB) when the node had 7.1 GiB of its "
                               "23.5 GiB in use (its kill threshold: 2%, RAY_memory_usage_threshold)")
    assert read_oom(RAY_OOM_2_60).describe() == seen.describe()
    gpu = read_oom(CUDA_OOM)
    assert (gpu.where, gpu.requested, gpu.total, gpu.process) == ("gpu", 2 * GiB, 79.15 * GiB, 78.08 * GiB)
    assert read_oom("injected out-of-memory at step 3 (train.faults): " + CUDA_OOM).injected
    assert read_oom("RuntimeError: boom") is None


def test_a_refused_host_allocation_is_read_from_torch_itself():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory=1 grants any allocation: nothing is refused")
    with pytest.raises(RuntimeError) as e:  # twice the machine's memory: refused at once, nothing touched
        torch.empty(2 * (info["MemTotal"] + info.get("SwapTotal", 0)), dtype=torch.uint8)
    seen = read_oom(str(e.value))
    assert seen.source == "host allocator" and seen.requested == 2 * (info["MemTotal"] + info.get("SwapTotal", 0))


def test_an_injected_oom_is_retried_and_a_real_one_is_found_inside_its_wrappers():
    """What the controller's failure callback decides on (raytrain/oom.py:find_oom, no Ray needed): the
    ``oom`` of train.faults fires once and is retried like any fault; a real one, however wrapped, stops."""
    from minimind_ray.raytrain.oom import find_oom

    injected = torch.OutOfMemoryError("injected out-of-memory at step 2 (train.faults, simulated on CPU)")
    assert find_oom(injected)[0].injected
    assert find_oom(torch.OutOfMemoryError("injected out-of-memory at step 2 (train.faults): " + CUDA_OOM))[0].injected
    wrapper = RuntimeError("Training failed due to worker errors")
    wrapper.__cause__ = torch.OutOfMemoryError(CUDA_OOM)
    seen, text = find_oom(wrapper)
    assert (seen.where, seen.injected, seen.total) == ("gpu", False, 79.15 * GiB) and text == CUDA_OOM
    monitor = RuntimeError("A worker health check failed.")
    monitor.health_check_failure = RuntimeError(RAY_OOM)  # how Ray Train wraps a worker the monitor killed
    assert find_oom(monitor)[0].source == "memory monitor"
    assert find_oom(RuntimeError("boom")) is None


def test_fsdp_shards_the_state_over_the_workers_and_checkpointing_keeps_block_inputs_only():
    ddp = estimate(_cfg("cluster.num_workers=4"), 8)
    fsdp4, fsdp8 = (estimate(_cfg("train.parallelism=fsdp", "train.micro_batch_size=8", f"cluster.num_workers={w}"), 8)
                    for w in (4, 8))
    assert (ddp.strategy, fsdp4.strategy) == ("ddp", "fsdp over 4 workers")
    for part in ("parameters", "AdamW"):
        assert fsdp4.parts[part] == ddp.parts[part] / 4 and fsdp8.parts[part] == ddp.parts[part] / 8
    assert fsdp4.parts["activations"] == ddp.parts["activations"] and fsdp4.total > fsdp8.total
    one = estimate(_cfg("train.parallelism=fsdp", "cluster.num_workers=1"), 8)  # sharded over one rank: all of it
    assert one.strategy == "fsdp over 1 worker" and one.parts["AdamW"] == ddp.parts["AdamW"]
    keep = estimate(_cfg("train.parallelism=fsdp", "cluster.num_workers=4", "train.reshard_after_forward=false"), 8)
    assert keep.parts["gathered"] > 2 * fsdp4.parts["gathered"]  # every block held from its forward to its backward
    ac = estimate(_cfg("train.parallelism=fsdp", "cluster.num_workers=4", "train.activation_checkpointing=blocks"), 8)
    assert ac.strategy == "fsdp over 4 workers, activation checkpointing"
    assert ac.parts["activations"] < fsdp4.parts["activations"] / 4
    # on a GPU: bf16 weights gathered, no CPU heap term
    gpu = estimate(_cfg("train.parallelism=fsdp", "cluster.num_workers=4"), 8, "cuda")
    assert gpu.precision == "bf16-weights" and "heap slack" not in gpu.parts
    assert gpu.parts["gathered"] == fsdp4.parts["gathered"] / 2
    # a 1B model that no micro-batch fits under DDP on a 10 GiB budget: the advice names what shards and checkpoints
    said = advice(_cfg("cluster.num_workers=2", "model.preset=minimind2-1b"), 2, 10 * GiB, "cuda")
    assert said.startswith("even train.micro_batch_size=1 needs about") and (
        ", or set train.parallelism=fsdp train.activation_checkpointing=blocks (about ") in said
