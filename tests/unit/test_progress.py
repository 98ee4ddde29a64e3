"""Issue 11, item 22: the driver's ETA comes from the workers' own step times, not from when progress
messages happen to arrive (they arrive in bursts: a burst used to read as an infinite rate, ETA 00:00:00)."""
from __future__ import annotations

from minimind_ray.raytrain.progress import ProgressPrinter, eta_seconds


def _m(step, step_time_s=0.5, total=30):
    return {"step": step, "total_steps": total, "epoch": 0, "loss": 2.0, "tokens_per_s": 1000.0,
            "step_time_s": step_time_s}


def test_eta_from_the_workers_step_time_even_in_a_burst(capsys):
    printer = ProgressPrinter(sink=None, run="", name="run")
    for step in (2, 4, 6):  # three messages delivered at once
        printer.show(_m(step))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("[run] step 6/30") and lines[-1].endswith("ETA 00:00:12"), lines
    assert [line.split("ETA ")[1] for line in lines] == ["00:00:14", "00:00:13", "00:00:12"]


def test_eta_unknown_without_a_step_time():
    assert eta_seconds({"step": 3, "total_steps": 10}) != eta_seconds({"step": 3, "total_steps": 10})  # nan
    assert eta_seconds(_m(30)) == 0.0


def test_an_rl_run_shows_its_reward_not_its_loss():
    from minimind_ray.stages import get_stage

    grpo = get_stage("grpo")
    line = ProgressPrinter.describe({**_m(5), "loss": 0.0012, "reward": 0.4375,
                                     "reward_exact_answer": 0.25, "kl": 0.0031}, grpo.headline, grpo.rl)
    assert line == "ep 0 reward 0.4375 exact 0.2500 kl 0.0031 tok/s 1,000"
    assert "loss" not in line
    assert ProgressPrinter.describe(_m(5)).startswith("ep 0 loss 2.0000 ")
    assert ProgressPrinter.describe({**_m(5), "reward": 0.5}, grpo.headline, grpo.rl) == \
        "ep 0 reward 0.5000 tok/s 1,000"  # beta 0: no kl


def test_each_stage_shows_its_records_headline_metrics():
    """Issue 38: DPO's reward margin and accuracy, distillation's KL, on the console as in MLflow."""
    from minimind_ray.stages import STAGES

    m = {**_m(5), "reward_margin": 0.75, "reward_accuracy": 0.625, "kl": 0.125, "reward": 0.5, "eval_loss": 1.5}
    lines = {name: ProgressPrinter.describe(m, s.headline, s.rl) for name, s in STAGES.items()}
    assert lines["dpo"] == lines["simpo"] == "ep 0 loss 2.0000 margin 0.7500 acc 0.6250 tok/s 1,000 eval 1.5000"
    assert lines["distill"] == "ep 0 loss 2.0000 kl 0.1250 tok/s 1,000 eval 1.5000"
    assert lines["kto"] == "ep 0 loss 2.0000 kl 0.1250 acc 0.6250 tok/s 1,000 eval 1.5000"
    assert lines["ppo"] == lines["agent"] == "ep 0 reward 0.5000 kl 0.1250 tok/s 1,000 eval 1.5000"
    assert lines["pretrain"] == lines["sft"] == "ep 0 loss 2.0000 tok/s 1,000 eval 1.5000"
    printer = ProgressPrinter(sink=None, run="", name="dpo-run", headline=STAGES["dpo"].headline)
    assert printer.line(m).startswith("[dpo-run] step 5/30 ep 0 loss 2.0000 margin 0.7500 acc 0.6250 ")


def test_the_progress_sink_keeps_each_open_run_apart_and_drops_late_pushes():
    """One ProgressSink actor serves every run a driver process trains: each run's lines go to that run's printer
    only, and a push that arrives after its run closed (a dying rank 0's last one) is dropped, not shown later under
    the next run's name."""
    from minimind_ray.raytrain.progress import ProgressSink

    sink = ProgressSink()
    sink.open("a")
    sink.push("a", _m(2))
    sink.push("never-opened", _m(4))
    sink.open("b")
    sink.push("b", _m(6))
    assert sink.drain("a") == [_m(2)] and sink.drain("a") == []
    sink.close("a")
    sink.push("a", _m(8))  # late
    assert sink.drain("a") == [] and sink.drain("b") == [_m(6)] and sink.drain("never-opened") == []
    for step in range(1, 1201):
        sink.push("b", _m(step, total=2000))
    assert [m["step"] for m in sink.drain("b")] == list(range(201, 1201))  # the newest 1000
