"""``loss``: the training objective's loss, perplexity and bits per byte of any weights on a held-out split (what
``minimind-ray eval WEIGHTS`` computes without ``--task``, as before; bits per byte since issue 36: it compares
models whose tokenizers differ, engine/evaluate.py).

The held-out split is the data pipeline's (sequences whose sample-id hash falls under ``data.eval_fraction``), so a
run's eval split is never trained on. The loss is the same objective and the same sums the training loop's
evaluation uses (minimind_ray/engine/evaluate.py), on one process, in eval mode: the task measures a split, not
questions, so it overrides the registry's ``evaluate`` (lm-eval's ``loglikelihood_rolling`` tasks are its kin).
``data`` is a prepared dir, all of it ('' = the eval split of the run the weights come from), ``batch_size`` the
sequences per micro-batch and ``limit`` the micro-batches to use.

Data given with ``data`` gets the tokenizer check training applies
(:func:`minimind_ray.data.manifest.check_tokenizer`): a loss on ids that mean other tokens is no measurement.
"""
from __future__ import annotations

import json
import logging
from typing import Dict, Optional, Tuple

from minimind_ray.data.formats import REGISTRY, get_format
from minimind_ray.engine.evaluate import eval_metrics, eval_sums
from minimind_ray.evals.config import EvalTaskConfig
from minimind_ray.evals.registry import EvalTask
from minimind_ray.stages.objective import Objective
from minimind_ray.tokenizer_fetch import TokenizerFetchError

log = logging.getLogger(__name__)
# what the verb prints: as before the registry, and eval_bpb when the bytes of the tokens are known
SUMMARY_KEYS = ("eval_loss", "eval_ppl", "eval_bpb", "eval_units")


def _weights_tokenizer_hash(lw, tokenizer: Optional[str]) -> Tuple[Optional[str], str]:
    """(hash of the tokenizer the weights were trained with, how to name it), or (None, why it is unknown)."""
    from minimind_ray.data.manifest import DataError, read_manifest  # lazy: pyarrow, only when this runs
    from minimind_ray.tokenizer import load_tokenizer, resolve_tokenizer  # lazy: tokenizers, only when this runs

    data = lw.run_config["data"] if lw.run_config else None  # the run's recorded config (a plain dict)
    if tokenizer:
        tok = resolve_tokenizer(tokenizer, data["cache_dir"] if data else "data_cache", lw.model_cfg.generation)
        return tok.hash(), f"--tokenizer {tokenizer!r}"
    if lw.tokenizer_dir:
        return load_tokenizer(lw.tokenizer_dir).hash(), f"the tokenizer of {lw.source}"
    if lw.meta is None:
        return None, f"{lw.source} records no tokenizer (pass --tokenizer)"
    try:  # the data the run trained on records its tokenizer's hash: no tokenizer files needed
        return read_manifest(lw.meta.prepared_dir)["tokenizer_hash"], f"the tokenizer {lw.source} was trained with"
    except (OSError, DataError):
        pass
    try:
        tok = resolve_tokenizer(data["tokenizer"], data["cache_dir"], lw.model_cfg.generation)
    except (OSError, ValueError, TokenizerFetchError) as e:
        return None, f"the tokenizer of {lw.source} is not at hand ({e}; pass --tokenizer)"
    return tok.hash(), f"data.tokenizer {data['tokenizer']!r} of {lw.source}"


def _token_bytes(ds, target) -> Optional[list]:
    """The bytes each token id spells (bits per byte): as the prepared data recorded them, else from the weights'
    tokenizer when it is the one the data was tokenized with; None (no bits per byte) when neither is at hand."""
    if ds.token_bytes is not None:
        return ds.token_bytes
    try:
        tok = target.tokenizer
    except Exception as e:  # no tokenizer recorded or reachable: the loss stands without bits per byte
        log.warning("eval: no bits per byte: %s records no token bytes and the weights' tokenizer is not at hand "
                    "(%s)", ds.path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    return tok.token_bytes() if tok.hash() == ds.manifest["tokenizer_hash"] else None


class Loss(EvalTask):
    """The training objective's loss and perplexity on a prepared split (default: the run's own eval split)."""

    @classmethod
    def check(cls, cfg, where=""):
        pass  # no data = the eval split of the run the weights come from

    @classmethod
    def default_name(cls, cfg):
        return "loss"

    def evaluate(self, target) -> dict:
        from minimind_ray.data.manifest import DataError, check_tokenizer  # lazy: pyarrow, only when this runs
        from minimind_ray.data.stream import PreparedDataset, TrainStream  # lazy: numpy, pyarrow, only when this runs

        weights, data = target.weights, self.cfg.data or None
        model, lw = target.model, target.loaded
        if data is None:
            if lw.meta is None:
                raise ValueError(f"{weights}: --data is needed for weights that are not a run's checkpoint")
            data = lw.meta.prepared_dir
            split, frac = "eval", (lw.run_config or {}).get("data", {}).get("eval_fraction", 0.0)
            if frac <= 0:
                raise ValueError(f"the run of {weights} has no eval split (data.eval_fraction=0); pass --data")
        else:
            split, frac = "train", 0.0  # a separate held-out set: all of it
        ds = PreparedDataset(data, eval_fraction=frac)
        if split == "train":
            want, whose = _weights_tokenizer_hash(lw, target.tokenizer_spec)
            if want is None:
                log.warning("eval: cannot check that %s was tokenized with the weights' tokenizer: %s", data, whose)
            else:
                check_tokenizer(ds.manifest, data, want, whose, "prepare the data with the weights' tokenizer")
        if not get_format(ds.format).cross_entropy:  # its record says whether its targets are text to imitate
            raise ValueError(f"{data}: eval loss is defined for "
                             f"{'/'.join(n for n, f in REGISTRY.items() if f.cross_entropy)} data, not {ds.format!r}")
        n = ds.num_sequences(split)
        if n == 0:
            raise DataError(f"{data}: the {'eval split' if split == 'eval' else 'data'} holds no sequences: nothing "
                            f"to evaluate")
        objective = Objective(lw.run_config)  # the cross-entropy over the data's targets
        # eval_batches reads micro_batch_size rows at a time, the last batch shorter; the stream only needs its
        # batch sizes to fit one batch into the split, so a split smaller than a micro-batch is one short batch
        mb = min(self.cfg.batch_size, n)
        stream = TrainStream(ds, split=split, global_batch_size=mb, micro_batch_size=mb,
                             world_size=1, rank=0, seed=0, shuffle=False, prefetch_steps=0)
        try:
            sums = eval_sums(model, objective, stream.eval_batches(), limit=self.cfg.limit or 0, device=target.device,
                             token_bytes=_token_bytes(ds, target))
        finally:
            stream.close()
        return {**eval_metrics(sums), "eval_units": sums.weight, "data": data, "split": split}

    def metrics(self, summary):
        return {"loss": summary["eval_loss"], "ppl": summary["eval_ppl"],
                **({"bpb": summary["eval_bpb"]} if "eval_bpb" in summary else {})}

    def samples(self, items, summary):
        return []  # a split's loss has no questions

    def table(self, summary):
        return json.dumps({k: summary[k] for k in SUMMARY_KEYS if k in summary}, indent=1)


def evaluate_weights(weights: str, data: Optional[str] = None, preset: Optional[str] = None,
                     batches: int = 0, micro_batch_size: int = 8,
                     device: Optional[str] = None, tokenizer: Optional[str] = None) -> Dict[str, float]:
    """Evaluate ``weights`` on ``data`` (a prepared dir, all of it), or on the eval split of the run they
    came from: the ``loss`` task through the registry. ``tokenizer``: the weights' tokenizer, when they do not
    record it (a bare .pth)."""
    from minimind_ray.evals.run import evaluate_task  # lazy: numpy, pyarrow, only when this runs

    if micro_batch_size < 1 or batches < 0:
        raise ValueError(f"eval: micro_batch_size must be >= 1 (got {micro_batch_size}) and batches >= 0 "
                         f"(got {batches})")
    res = evaluate_task(weights, EvalTaskConfig(task="loss", data=data or "", batch_size=micro_batch_size,
                                                limit=batches or None), preset=preset, device=device,
                        tokenizer=tokenizer)
    return {k: res[k] for k in SUMMARY_KEYS if k in res}
