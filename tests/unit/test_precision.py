"""bf16 autocast and torch.compile, the GPU path's two switches, exercised on CPU (issue 15, part 5).

At the engine level (no Ray), on the fixture's 33k-parameter model and prepared data
(tests/fixtures/checkpoint_v1), 8 optimizer steps, against fp32 eager. Tolerances are the measured
differences times 4-5 (figures in docs/training.md, "bf16, torch.compile and the MoE dispatch without a GPU"):

* bf16 autocast: per-step loss within 2e-3 of fp32 (measured 4.0e-4 on a loss of ~5.9);
* torch.compile (inductor, fp32): per-step loss within 1e-6 (measured 2.4e-7), weights within 5e-7
  (measured 8.9e-8): the same arithmetic, fused into other kernels.

Compiling costs a cold inductor build (gcc, 31 C++ kernels) per distinct graph: the compiled runs share
one module fixture and one graph (fp32), so only the first builds; the others load it from inductor's
cache. Inductor's pool of compile workers is switched off here: on 2 shared cores it doubled the CPU cost
of the build (118 s against 64 s of CPU, measured). This file took 97 s of CPU cold, 22 s with inductor's
cache warm; on a machine shared with other work the wall time grows with the load (the compiled fixture
took 607 s at a load average of 12-20), hence the compiled tests' longer timeout.
"""
from __future__ import annotations

import pytest
import torch

from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.model.minimind import build_model
from minimind_ray.store.checkpoint import open_checkpoint
from minimind_ray.store.pth import read_pth
from tests.unit.test_engine import PREPARED, fixture_config

STEPS = 8
BF16_LOSS_TOL = 2e-3
COMPILE_LOSS_TOL, COMPILE_WEIGHT_TOL = 1e-6, 5e-7
COMPILE_TIMEOUT = pytest.mark.timeout(1800)  # the first compiled test pays for the build (see above)


class Recorder(Hooks):
    def __init__(self):
        self.losses = {}

    def on_metrics(self, step, metrics, per_step_loss, is_checkpoint):
        self.losses.update(per_step_loss)


def train(**train_cfg):
    """-> (state after STEPS steps, {step: global mean loss})."""
    state = TrainState.build(fixture_config(max_steps=STEPS, **train_cfg), PREPARED)
    rec = Recorder()
    run(state, rec)
    return state, rec.losses


@pytest.fixture(scope="module")
def fp32_eager():
    return train(precision="fp32")


def max_loss_gap(a, b):
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    return max(abs(a[s] - b[s]) for s in a)


def assert_minimind_keys(ckpt_dir, state):
    """model.pth holds exactly a plain model's keys, in its order, in fp32 (no module./_orig_mod.)."""
    saved = read_pth(str(ckpt_dir / "model.pth"))
    plain = build_model(state.cfg.model).state_dict()
    assert list(saved) == list(plain)
    assert all(v.dtype == torch.float32 for v in saved.values())


# --------------------------------------------------------------------------- bf16 autocast


def test_bf16_autocast_tracks_fp32(fp32_eager, tmp_path):
    _, fp32_losses = fp32_eager
    state, losses = train(precision="bf16")
    gap = max_loss_gap(losses, fp32_losses)
    assert 0 < gap < BF16_LOSS_TOL, gap  # 0 would mean autocast never switched on
    ids = torch.randint(0, state.cfg.model.vocab_size, (2, 8))
    with torch.no_grad(), state.autocast():
        assert state.forward_model(ids).logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in state.model.parameters())  # fp32 master weights
    state.save(tmp_path / "ck", mlflow_run_id=None, prepared_dir=PREPARED)
    assert_minimind_keys(tmp_path / "ck", state)


# --------------------------------------------------------------------------- torch.compile


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A compiled run of STEPS steps straight, and one stopped after a checkpoint at STEPS // 2, then
    continued by a fresh compiled state restored from that checkpoint."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    ck = tmp_path_factory.mktemp("compiled") / "ck"
    counters.clear()
    with inductor_config.patch(compile_threads=1):
        straight, losses = train(precision="fp32", compile=True)
        stats = {"graph_breaks": sum(counters["graph_break"].values()),
                 "graphs": counters["stats"]["unique_graphs"]}

        class StopAtHalf(Hooks):
            def on_checkpoint(self, step, metrics):
                if step == STEPS // 2:
                    first.save(ck, mlflow_run_id="run-1", prepared_dir=PREPARED)
                    raise KeyboardInterrupt  # stop here, as a crash would

        cfg = fixture_config(max_steps=STEPS, precision="fp32", compile=True)
        assert cfg.checkpoint.interval == STEPS // 2
        first = TrainState.build(cfg, PREPARED)
        with pytest.raises(KeyboardInterrupt):
            run(first, StopAtHalf())
        first.stream.close()
        resumed = TrainState.build(cfg, PREPARED)
        resumed.restore(open_checkpoint(ck))
        run(resumed)
    yield {"straight": straight, "losses": losses, "stats": stats, "first": first, "ck": ck, "resumed": resumed}
    torch._dynamo.reset()


@COMPILE_TIMEOUT
def test_compiled_run_tracks_fp32_eager(compiled, fp32_eager):
    eager, eager_losses = fp32_eager
    state = compiled["straight"]
    assert isinstance(state.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled["stats"]["graphs"] >= 1 and compiled["stats"]["graph_breaks"] == 0, compiled["stats"]
    assert max_loss_gap(compiled["losses"], eager_losses) < COMPILE_LOSS_TOL
    a, b = state.model.state_dict(), eager.model.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=COMPILE_WEIGHT_TOL, rtol=0)


@COMPILE_TIMEOUT
def test_compiled_checkpoint_keeps_minimind_keys(compiled):
    first = compiled["first"]
    assert any(k.startswith("_orig_mod.") for k in first.forward_model.state_dict())  # what a naive save would hold
    assert_minimind_keys(compiled["ck"], first)


@COMPILE_TIMEOUT
def test_compiled_run_resumes_bit_for_bit(compiled):
    a, b = compiled["straight"].model.state_dict(), compiled["resumed"].model.state_dict()
    assert compiled["resumed"].step == STEPS
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = compiled["straight"].optimizer.state_dict(), compiled["resumed"].optimizer.state_dict()
    for i, s in opt_a["state"].items():
        assert all(torch.equal(s[name], opt_b["state"][i][name]) for name in s)
