"""`make demo`: the main job on the built-in default, start to finish on one machine.

pretrain (demo preset, built-in corpus, 2 Ray workers) -> SFT from its checkpoint -> a few chat
replies -> where everything is (checkpoints, exports, MLflow run and UI command).
On a machine with GPUs the same flow runs the 26M default: pass `--gpu`.
"""
import argparse
import sys
import time

from minimind_ray.config import resolve_run
from minimind_ray.console import set_verbose
from minimind_ray.generate import generate_text
from minimind_ray.model.sampling import SamplingParams
from minimind_ray.raytrain.driver import run
from minimind_ray.raytrain.train_verb import print_run_summary
from minimind_ray.store.weights import build_inference_model

PROMPTS = ["What is the capital of France?", "What is 12 plus 7?", "中国的首都是哪里？", "Who are you?"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpu", action="store_true", help="use the 26M preset on GPU workers")
    ap.add_argument("--verbose", action="store_true", help="Ray's and MLflow's own lines too (MINIMIND_RAY_VERBOSE=1)")
    ap.add_argument("overrides", nargs="*", help="applied to both stages, e.g. cluster.num_workers=1")
    args = ap.parse_args(argv)
    set_verbose(args.verbose)
    extra = list(args.overrides)
    if args.gpu:  # one worker per local GPU, 16 sequences each per micro-step
        import torch

        n = max(torch.cuda.device_count(), 1)
        extra = ["model.preset=minimind2-small", "cluster.use_gpu=true", f"cluster.num_workers={n}",
                 f"train.global_batch_size={32 * n}", "train.micro_batch_size=16", *extra]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    t0 = time.time()

    pre = run(resolve_run("pipelines/configs/demo_pretrain.yaml", [f"name=demo-pretrain-{stamp}", *extra]))
    print_run_summary(pre)

    sft_run = resolve_run("pipelines/configs/demo_sft.yaml",
                          [f"name=demo-sft-{stamp}", f"train.init_from={pre.checkpoint_dir}", *extra])
    sft_cfg = sft_run.cfg
    sft = run(sft_run)
    print_run_summary(sft)

    model, lw = build_inference_model(sft.checkpoint_dir)
    from minimind_ray.tokenizer import resolve_tokenizer

    tok = resolve_tokenizer(sft_cfg.data.tokenizer, sft_cfg.data.cache_dir)
    print("\n==== the demo model answers (greedy) ====")
    for p in PROMPTS:
        print(f"> {p}")
        generate_text(model, tok, p, SamplingParams(max_new_tokens=48, temperature=0.0), out=sys.stdout)

    print_quality(sft_cfg, model, tok)

    print(f"\n==== done in {time.time() - t0:.0f}s ====")
    print(f"chat with it:    .venv/bin/minimind-ray chat {sft.run_dir}")
    print(f"serve it:        .venv/bin/minimind-ray serve {sft.run_dir}   "
          f"(OpenAI API + chat page on http://127.0.0.1:8000/)")
    print(f"export it:       .venv/bin/minimind-ray export {sft.run_dir} --out outputs/demo-export")
    if sft.mlflow_run_id:
        print(f"MLflow UI:       make ui   -> http://127.0.0.1:5000/#/experiments?workflowType=machine_learning  "
              f"(runs {pre.mlflow_run_id}, {sft.mlflow_run_id})")
    return 0


def print_quality(sft_cfg, model, tok) -> None:
    """The SFT model's accuracy on the demo's multiple-choice set (never trained on), beside a random-init model
    of the same size: what the training bought, measured (docs/evaluation.md)."""
    from minimind_ray.evals.run import evaluate_task
    from minimind_ray.model.minimind import build_model

    task = sft_cfg.eval.tasks[0]
    device = next(model.parameters()).device.type
    rows = []
    for name, m in (("demo SFT model", model), ("random init, same size", build_model(sft_cfg.model, seed=0))):
        res = evaluate_task("", task, model=m.to(device).eval(), tok=tok, cache_dir=sft_cfg.data.cache_dir,
                            device=device)
        rows.append((name, res))
    print(f"\n==== multiple choice: {rows[0][1]['n']} questions about the demo world (demo:mc_eval, 4 choices) ====")
    print(f"{'model':<26} {'acc':>6} {'acc_norm':>9}")
    for name, res in rows:
        print(f"{name:<26} {res['acc']:>6.1%} {res['acc_norm']:>9.1%}")


if __name__ == "__main__":
    sys.exit(main())
