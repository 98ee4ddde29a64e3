"""The agent demo's measured result (not a test): a calculator the small model learns to use.

  1. the starting model (a tool SFT of a demo SFT model: pipelines/configs/demo_tool_sft.yaml, run here from
     ``--sft`` unless ``--tool-sft`` names one): the eval verb's ``toolcall`` task on demo:toolcall_eval (200
     held-out sums "What is 3 plus 8 plus 5?" of three or four digits with the calculator offered, and 26
     questions that need no tool), and whole greedy agent trajectories on the same 200 (rl/turns.py: the tool run,
     its result read back): how many call the tool with the question's digits, how many end with the right sum
     (by the number of digits), how many of the right calls read the result back, and the mean reward;
  2. ``minimind-ray agent --config pipelines/configs/demo_agent.yaml train.init_from=<tool SFT run>``, timed;
  3. the same measurements of the agent model, and the run's reward curve from MLflow (10-step means).

Usage:  .venv/bin/python bench/bench_agent.py --sft runs/<demo-sft-run> [--tool-sft runs/<run>] [--agent runs/<run>]
                                              [overrides of demo_agent.yaml ...]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from common import rl_report, rl_run, timed

from minimind_ray.config import load_config
from minimind_ray.data.demo import resolve_demo_path
from minimind_ray.data.formats import Encoder, collate
from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.run import evaluate_task
from minimind_ray.generate import tokenizer_for_weights
from minimind_ray.raytrain.driver import run
from minimind_ray.rl.trajectory_rewards import answer_calls, build_agent_rewards, final_answer, gt_found, score_trajectories
from minimind_ray.rl.turns import agent_rollout
from minimind_ray.rl.rollout import SamplingParams, TorchRollout
from minimind_ray.rl.tools import ToolBox
from minimind_ray.store.weights import build_inference_model

KEYS = ("rl/reward", "rl/reward_gt_answer", "rl/reward_tool_calls", "rl/answer_correct", "rl/called_tool",
        "rl/tool_errors", "rl/turns", "rl/reward_std", "rl/completion_len", "rl/rollout_s", "perf/step_time_s")


def toolcall_scores(weights: str, cache_dir: str, max_new_tokens: int) -> dict:
    task = EvalTaskConfig(task="toolcall", data="demo:toolcall_eval", max_new_tokens=max_new_tokens, batch_size=50)
    return evaluate_task(weights, task, cache_dir=cache_dir)


def agent_scores(weights: str, cfg) -> dict:
    """Greedy trajectories of the arithmetic prompts of demo:toolcall_eval through the agent stage's own rollout, each
    prompt encoded and collated as the stage's ``agent_rl`` records are (data/formats/agent_rl.py)."""
    model, lw = build_inference_model(weights, "demo", device="cpu")
    tok = tokenizer_for_weights(lw, "builtin")
    path = resolve_demo_path("demo:toolcall_eval", "", os.path.abspath(cfg.data.cache_dir))
    recs = [r for r in map(json.loads, open(path)) if r["subject"] == "arithmetic"]
    engine, box = TorchRollout(), ToolBox(cfg.train.agent.tools)
    engine.update_policy(model, 0)
    params = SamplingParams(cfg.train.agent.max_gen_len, 0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)  # greedy
    terms, trajs = build_agent_rewards(cfg.train.agent.rewards), []
    encoder = Encoder("agent_rl", tok, cfg.data.max_seq_len)  # as the stage's prepare job encodes its records
    for i in range(0, len(recs), 25):
        chunk = recs[i:i + 25]
        # an agent_rl record: the tools in the system turn, the sum the answer to find (the last turn is not used)
        issues = encoder.add([{"conversations": [{**r["messages"][0], "tools": r["tools"]}, *r["messages"][1:],
                                                 {"role": "assistant", "content": ""}], "gt": [r["answer"]]}
                              for r in chunk])
        if issues:
            raise ValueError(f"demo:toolcall_eval as agent_rl records: {issues}")
        mb = collate("agent_rl", encoder.take(), np.arange(i, i + len(chunk)), tok.pad_id, cfg.data.max_seq_len)
        got, _ = agent_rollout(mb, engine=engine, params=params, group_size=1, toolbox=box, tokenizer=tok,
                               max_turns=cfg.train.agent.max_turns, max_total_len=cfg.train.agent.max_total_len,
                               seed=0, step=0, device="cpu")
        trajs += got
    box.close()
    rewards, _ = score_trajectories(terms, trajs, cfg.train.agent.reward_clip)
    n = len(trajs)
    right = [all(gt_found(final_answer(t), t.gt, "exact")) for t in trajs]
    good_call = [any(json.loads(resp).get("result") == r["answer"] for resp in t.responses) for r, t in zip(recs, trajs)]
    by_len = {}
    for r, ok in zip(recs, right):
        by_len.setdefault(len(r["arguments"]["expression"].split("+")), []).append(ok)
    return {"n": n, "called": sum(bool(answer_calls(t)) for t in trajs) / n, "correct": sum(right) / n,
            "good_call": sum(good_call) / n, "read_back": sum(r for r, g in zip(right, good_call) if g) / max(1, sum(good_call)),
            "by_len": {k: sum(v) / len(v) for k, v in sorted(by_len.items())},
            "reward": sum(rewards) / n, "example": trajs[0].turns}


def report(title: str, tc: dict, ag: dict) -> None:
    sub = tc["subjects"]
    by_len = ", ".join(f"{k} digits {v:6.1%}" for k, v in ag["by_len"].items())
    print(f"{title:<26} toolcall acc {tc['acc']:6.1%} (arithmetic {sub['arithmetic']['acc']:6.1%}: name "
          f"{sub['arithmetic']['name_acc']:6.1%}, args valid {sub['arithmetic']['args_valid']:6.1%}, args as expected "
          f"{sub['arithmetic']['args_match']:6.1%}; no tool {sub['no tool']['acc']:6.1%})\n{'':<26} agent, greedy: "
          f"called {ag['called']:6.1%}, the right sum from the tool {ag['good_call']:6.1%}, read back "
          f"{ag['read_back']:6.1%} of those, right sum {ag['correct']:6.1%} ({by_len}), reward {ag['reward']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="the demo SFT run (directory)")
    ap.add_argument("--tool-sft", help="an existing tool SFT run (else demo_tool_sft.yaml is run from --sft)")
    ap.add_argument("--agent", help="an existing agent run to measure instead of training one")
    ap.add_argument("--config", default="pipelines/configs/demo_agent.yaml")
    ap.add_argument("overrides", nargs="*", help="applied to the agent recipe, e.g. train.max_steps=20")
    args = ap.parse_args()
    tool_sft = args.tool_sft
    if tool_sft is None:
        res, wall = timed(run, load_config("pipelines/configs/demo_tool_sft.yaml", [f"train.init_from={args.sft}"]))
        tool_sft = res.run_dir
        print(f"tool SFT: {res.run_dir} in {wall:.0f} s wall")
    cfg = load_config(args.config, [f"train.init_from={tool_sft}", *args.overrides])
    tokens = cfg.train.agent.max_gen_len
    before = toolcall_scores(tool_sft, cfg.data.cache_dir, tokens), agent_scores(tool_sft, cfg)
    run = rl_run(cfg, args.agent)
    after = toolcall_scores(run.run_dir, cfg.data.cache_dir, tokens), agent_scores(run.run_dir, cfg)
    print("\n==== the calculator demo (demo:toolcall_eval: 200 held-out sums of 3 or 4 digits) ====")
    report("tool SFT (before)", *before)
    report("agent (after)", *after)
    print(f"greedy example before: {before[1]['example']}\n               after:  {after[1]['example']}")
    rl_report("agent", cfg, run, KEYS, 10)


if __name__ == "__main__":
    main()
