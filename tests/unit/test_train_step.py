"""engine/step.py's train_step against sums worked out by hand (issue 34: its mutants survived every test that
compares a run with another run of the same code, and AdamW hides a gradient's scale). A toy objective (a linear
model, squared error, an aux term) on a state of plain parts with SGD, so every number of the step can be written
down: the gradient of the global batch's mean, the per-update counts, the passes, the early stop, a trained part
with its own clip, and, over a real one-process gloo group standing for a world of 2, DDP's no_sync on all but the
last micro-batch. No Ray."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from minimind_ray.engine.step import train_step


class Toy:
    """An objective: loss_sum = sum of squared errors of ``w x`` (+ the part's, when there is one), aux = 0.1 |w|^2,
    one extra metric counting rows; ``keep`` says per update whether to keep it."""

    def __init__(self, passes: int = 1, keep=None, with_part: bool = False, split: bool = False):
        self.passes, self.keep, self.with_part, self.split = passes, list(keep or []), with_part, split
        self.calls, self.prepared, self.ended, self.asked = 0, [], [], []

    def prepare(self, state, batches, step):
        self.prepared.append((state, step))
        return batches

    def update_plan(self, batches):
        """``passes`` passes of one update of every micro-batch, or (``split``) of an update per micro-batch."""
        return [[[b] for b in batches] if self.split else [batches] for _ in range(self.passes)]

    def weight(self, b):
        return len(b["y"])

    def metric_weight(self, b):
        return 2 * len(b["y"])

    def tokens(self, b):
        return 10 * len(b["y"])

    def loss_sum(self, model, mb):
        self.calls += 1
        loss = ((model(mb["x"]).squeeze(-1) - mb["y"]) ** 2).sum()
        if self.with_part:
            loss = loss + ((self.part(mb["x"]).squeeze(-1) - mb["y"]) ** 2).sum()
        return loss, 0.1 * (model.weight ** 2).sum(), {"rows": torch.tensor(float(len(mb["y"])))}

    def keep_update(self, state):
        self.asked.append(state)
        return self.keep.pop(0) if self.keep else True

    def end_step(self, state, out):
        self.ended.append((state, out))


class SyncRecorder:
    """Which micro-batches DDP's no_sync is asked for (by the objective's count of loss_sum calls before each), as a
    world of 2 over one process has no DDP to ask."""

    def __init__(self, obj):
        self.obj, self.at = obj, []

    @property
    def entered(self) -> int:
        return len(self.at)

    @contextlib.contextmanager
    def no_sync(self):
        self.at.append(self.obj.calls)
        yield


def _linear(values):
    m = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([values]))
    return m


def _state(obj, world=1, grad_clip=0.0, part=None):
    model = _linear([0.5, -1.0, 2.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    state = SimpleNamespace(objective=obj, world=world, device=torch.device("cpu"), forward_model=model,
                            ddp_model=SyncRecorder(obj), params=list(model.parameters()), optimizer=opt,
                            scheduler=sched, cfg=SimpleNamespace(train=SimpleNamespace(grad_clip=grad_clip)),
                            autocast=contextlib.nullcontext, step=0)  # no ``parts``: a stage without any
    if part is not None:
        popt = torch.optim.SGD(part.parameters(), lr=0.1)
        state.parts = {"critic": SimpleNamespace(ddp_model=SyncRecorder(obj), params=list(part.parameters()),
                                                 optimizer=popt, scheduler=torch.optim.lr_scheduler.LambdaLR(
                                                     popt, lambda s: 0.5 ** s))}
        obj.part = part
    return state


BATCHES = [{"x": torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 0.0], [1.0, 1.0, 1.0]]), "y": torch.tensor([1.0, 0.0, 2.0])},
           {"x": torch.tensor([[2.0, 0.0, 0.0]]), "y": torch.tensor([3.0])}]


def _by_hand(weights, batches=BATCHES, scale=None, aux=True):
    """(sum of squared errors over ``batches``, aux, gradient of scale x that sum, plus aux's) at ``weights``; the
    scale defaults to the mean's, 1 / rows."""
    w = torch.tensor([list(weights)], requires_grad=True)
    sse = sum(((b["x"] @ w.T).squeeze(-1) - b["y"]).pow(2).sum() for b in batches)
    penalty = 0.1 * (w ** 2).sum()
    scale = 1 / sum(len(b["y"]) for b in batches) if scale is None else scale
    (sse * scale + (penalty if aux else 0)).backward()
    return sse.detach(), penalty.detach(), w.grad


def test_one_update_is_the_gradient_of_the_global_batchs_mean_plus_aux():
    obj = Toy()
    state = _state(obj)
    out = train_step(state, BATCHES, 7)
    sse, aux, grad = _by_hand([0.5, -1.0, 2.0])
    assert torch.allclose(state.forward_model.weight, torch.tensor([[0.5, -1.0, 2.0]]) - 0.1 * grad)
    assert torch.allclose(out.grad_norm, grad.norm())
    assert out.loss_sum.dtype == torch.float64 and torch.allclose(out.loss_sum, sse.double())
    assert (float(out.weight), float(out.metric_weight), out.tokens) == (4.0, 8.0, 40)
    assert out.aux.dtype == torch.float64 and torch.allclose(out.aux, aux.double())  # the micro-batches', averaged
    assert float(out.extras["rows"]) == 4.0 and out.extras["rows"].dtype == torch.float64
    assert (out.step, out.lr, state.step) == (7, 0.1, 7)
    assert state.scheduler.get_last_lr()[0] == pytest.approx(0.05)  # stepped once after the step
    assert obj.prepared == [(state, 7)] and obj.ended == [(state, out)] and obj.calls == 2 and obj.asked == [state]
    assert all(p.grad is None for p in state.params)  # zeroed with set_to_none
    assert state.ddp_model.entered == 0  # one rank: every micro-batch syncs


def test_a_clipped_step_reports_the_norm_before_clipping():
    state = _state(Toy(), grad_clip=0.5)
    out = train_step(state, BATCHES, 1)
    _, _, grad = _by_hand([0.5, -1.0, 2.0])
    assert float(grad.norm()) > 0.5 and torch.allclose(out.grad_norm, grad.norm())
    step = torch.tensor([[0.5, -1.0, 2.0]]) - state.forward_model.weight.detach()
    assert torch.allclose(step.norm(), torch.tensor(0.1 * 0.5), atol=1e-6)  # lr x the clip


def test_passes_update_again_and_count_their_units_once():
    """GRPO's num_iterations: two passes over the same micro-batches, an optimizer update each; the loss is the
    passes' mean, the units (and metric units) those of one pass, aux averaged over every micro-step."""
    obj = Toy(passes=2)
    state = _state(obj)
    out = train_step(state, BATCHES, 1)
    w0 = torch.tensor([[0.5, -1.0, 2.0]])
    sse0, aux0, g0 = _by_hand(w0[0].tolist())
    w1 = w0 - 0.1 * g0
    sse1, aux1, g1 = _by_hand(w1[0].tolist())
    assert torch.allclose(state.forward_model.weight, w1 - 0.1 * g1, atol=1e-6)
    assert torch.allclose(out.loss_sum, ((sse0 + sse1) / 2).double(), atol=1e-6)
    assert torch.allclose(out.aux, ((aux0 + aux1) / 2).double(), atol=1e-6)
    assert (float(out.weight), float(out.metric_weight), out.tokens, obj.calls) == (4.0, 8.0, 80, 4)
    assert float(out.extras["rows"]) == 8.0 and torch.allclose(out.grad_norm, g1.norm(), atol=1e-6)


# torch warns that the schedule moved before any optimizer step: on a step whose every update was dropped, it did
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_an_update_the_objective_drops_stops_the_step_without_stepping():
    """PPO's early stop on KL: the first update's gradients are dropped, no optimizer steps, the second pass never
    runs; the schedule still moves (the step happened)."""
    part = _linear([1.0, 1.0, 1.0])
    obj = Toy(passes=2, keep=[False], with_part=True)
    state = _state(obj, part=part)
    out = train_step(state, BATCHES, 3)
    assert state.forward_model.weight.tolist() == [[0.5, -1.0, 2.0]] and part.weight.tolist() == [[1.0, 1.0, 1.0]]
    assert all(p.grad is None for p in [*state.params, *part.parameters()]) and obj.calls == 2
    assert float(out.grad_norm) == 0.0 and float(out.weight) == 4.0 and state.step == 3
    assert state.scheduler.last_epoch == 1 and state.parts["critic"].scheduler.last_epoch == 1


def test_a_trained_part_steps_with_its_own_clip():
    part = _linear([1.0, 1.0, 1.0])
    state = _state(Toy(with_part=True), grad_clip=0.5, part=part)
    train_step(state, BATCHES, 1)
    _, _, grad = _by_hand([1.0, 1.0, 1.0], aux=False)
    assert float(grad.norm()) > 0.5
    want = torch.tensor([[1.0, 1.0, 1.0]]) - 0.1 * grad * (0.5 / grad.norm())
    assert torch.allclose(part.weight, want, atol=1e-6)
    assert all(p.grad is None for p in part.parameters())
    assert state.parts["critic"].scheduler.get_last_lr()[0] == pytest.approx(0.05)


def test_a_world_of_two_syncs_only_the_last_micro_batch_and_scales_by_the_world(tmp_path):
    """Over a real gloo group of one process standing for a world of 2: the units are all-reduced (here: themselves),
    each rank's gradient is the world times the global mean's (DDP then averages over the ranks), and DDP's no_sync
    holds the all-reduce back on every micro-batch but the last, for the policy and each trained part."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        part = _linear([1.0, 1.0, 1.0])
        state = _state(Toy(with_part=True), world=2, part=part)
        out = train_step(state, BATCHES + [BATCHES[1]], 1)
        assert state.ddp_model.at == state.parts["critic"].ddp_model.at == [0, 1]  # micro-batches 0 and 1, not 2
        _, _, grad = _by_hand([1.0, 1.0, 1.0], BATCHES + [BATCHES[1]], scale=2 / 5, aux=False)  # grad_clip 0: whole
        assert torch.allclose(part.weight, torch.tensor([[1.0, 1.0, 1.0]]) - 0.1 * grad, atol=1e-6)
        assert float(out.weight) == 5.0
        sharded = _state(Toy(), world=2)
        sharded.sharded = True  # FSDP reduce-scatters every micro-batch: no no_sync
        train_step(sharded, BATCHES, 1)
        assert sharded.ddp_model.entered == 0
    finally:
        dist.destroy_process_group()
    plain = _state(Toy(), world=2)
    with pytest.raises(ValueError, match="(?i)process group"):  # a world of 2 needs its group for the units
        train_step(plain, BATCHES, 1)
    _, _, grad = _by_hand([0.5, -1.0, 2.0], BATCHES + [BATCHES[1]], scale=2 / 5)
    assert torch.allclose(out.grad_norm, grad.norm())


def test_precision_on_a_gpu_follows_its_bf16(monkeypatch):
    """A GPU stood in for by torch.cuda's two answers (this machine has none): auto computes in bf16 where the GPU
    has it and in fp32 where it has not; bf16 asked for on such a GPU is refused naming it."""
    from minimind_ray.config_checks import ConfigError
    from minimind_ray.engine.step import autocast_for, bf16_compute, check_precision

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: {gpu: "Tesla T4"}[device])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert (bf16_compute("auto", gpu), bf16_compute("fp32", gpu)) == (False, False)
    with pytest.raises(ConfigError, match=r"^train.precision: bf16 needs a GPU with bf16 .*; Tesla T4 has none: use "
                                          r"train.precision=fp32 \(or auto\)$"):
        bf16_compute("bf16", gpu)
    with pytest.raises(ConfigError, match="; this GPU has none"):  # no name known
        check_precision("bf16", "cuda", bf16_supported=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert (bf16_compute("auto", gpu), bf16_compute("bf16", gpu), bf16_compute("fp32", gpu)) == (True, True, False)
    with pytest.warns(UserWarning, match="CUDA is not available"):  # torch's, on a machine without one
        ctx = autocast_for("auto", gpu)()
    assert (ctx.device, ctx.fast_dtype) == ("cuda", torch.bfloat16)  # not CUDA autocast's default, fp16


def test_updates_of_one_pass_add_their_units():
    """GRPO's mini-batches: one pass of an update per micro-batch; the step's units are the pass's, summed."""
    obj = Toy(split=True)
    state = _state(obj)
    out = train_step(state, BATCHES, 1)
    assert (float(out.weight), float(out.metric_weight), obj.calls, len(obj.asked)) == (4.0, 8.0, 2, 2)
    w0 = torch.tensor([[0.5, -1.0, 2.0]])
    _, _, g0 = _by_hand(w0[0].tolist(), [BATCHES[0]])  # the first update: batch 0 alone, its own mean
    w1 = w0 - 0.1 * g0
    _, _, g1 = _by_hand(w1[0].tolist(), [BATCHES[1]])
    assert torch.allclose(state.forward_model.weight, w1 - 0.1 * g1, atol=1e-6)
