"""``train.rollout.engine: actors``: generation on a pool of Ray actors, the training workers only train.

verl's and OpenRLHF's design on this project's engine, behind the same :class:`~minimind_ray.rl.rollout.RolloutEngine`
seam as the in-worker sampler:

* ``train.rollout.actors`` :class:`RolloutActor` s, named ``minimind-rollout-<run>-<i>``, each holding a copy of the
  policy (``actor_cpus`` / ``actor_gpus`` each, one torch thread per CPU).
* Weights once per step: rank 0 ``ray.put``s the policy's state dict and hands the reference to every actor
  (:meth:`ActorRollout.update_policy`); each actor keeps the two versions it received last, and a request
  names the version it was made for, so a late request never samples from newer weights.
* Every rank sends its own requests (each completion with its own seed, rollout.row_seeds) to the pool,
  request j of rank r to actor (r + j * world) mod N, and gets its rollouts back: a step's micro-batches as one
  request (rollout.merge_requests, as the in-worker sampler batches them), an overlapped step's one per
  micro-batch. An actor computes exactly what the worker would (the same function, rows and seeds), so a run
  with actors equals one without.
* ``submit``/``collect`` split a request in two, for the overlap of step t+1's generation with step t's update
  (rl/plan.py).
* An actor that died (a lost node, a kill) is created again under its name by the first rank that notices,
  given the request's weights from that rank's own copy, and the request is sent again.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, Optional

import torch
from torch import Tensor

from minimind_ray.failures import NotPlaced
from minimind_ray.model.prefix_cache import PrefixCache
from minimind_ray.model.sampling import SamplingParams
from minimind_ray.rl.constraints import compiler_of
from minimind_ray.rl.rollout import Rollout, RolloutEngine, merge_requests, sample_completions, split_rollout


class RolloutActor:
    """One copy of the policy that generates on request (the Ray actor's class)."""

    def __init__(self, model_cfg: dict, threads: int, prefix_cache_mb: float = 0.0,
                 tokenizer: Optional[tuple] = None):
        """``tokenizer``: (its HF JSON, its EOS id) when the stage constrains its rollouts (rl/constraints.py):
        the grammars are compiled here for it."""
        from minimind_ray.model.config import ModelConfig  # lazy: omegaconf, yaml, only when this runs
        from minimind_ray.model.minimind import build_model  # lazy: torch, only when this runs

        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = build_model(ModelConfig(**model_cfg)).to(self.device).eval()
        self.prefix_cache = PrefixCache.of_mib(prefix_cache_mb)  # emptied by each load_state_dict (check_weights)
        self.grammars = compiler_of(*tokenizer, self.model.cfg.vocab_size) if tokenizer else None
        self.weights: "OrderedDict[int, dict]" = OrderedDict()  # version -> state dict: the two loaded last
        self.loaded: Optional[int] = None
        self.cond = threading.Condition()
        self.generating = threading.Lock()

    def load(self, version: int, state_dict: dict) -> int:
        with self.cond:  # by arrival, not by number: a restarted run counts its versions from its restart step
            self.weights.pop(version, None)
            self.weights[version] = state_dict
            while len(self.weights) > 2:
                self.weights.popitem(last=False)
            if self.loaded == version:
                self.loaded = None  # the same version number with other weights (a restart): load them again
            self.cond.notify_all()
        return version

    def has(self, version: int) -> bool:
        return version in self.weights

    def generate(self, version: int, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 seeds: Tensor, timeout_s: float = 600.0) -> Rollout:
        with self.cond:
            if not self.cond.wait_for(lambda: version in self.weights, timeout=timeout_s):
                raise TimeoutError(f"rollout actor: weights version {version} never arrived ({sorted(self.weights)})")
            weights = self.weights[version]
        with self.generating:  # one request at a time: the model's weights are swapped per version
            if self.loaded != version:
                self.model.load_state_dict(weights)
                self.loaded = version
            roll = sample_completions(self.model, prompt_ids.to(self.device), prompt_mask.to(self.device), params,
                                      seeds=seeds.to(self.device), prefix_cache=self.prefix_cache,
                                      grammars=self.grammars)
        return Rollout(*(t.cpu() for t in (roll.completion_ids, roll.completion_mask, roll.logprobs, roll.truncated)))

    def pid(self) -> int:
        import os

        return os.getpid()


def actor_name(run_name: str, index: int) -> str:
    return f"minimind-rollout-{run_name}-{index}"


class RolloutActorsNotPlaced(NotPlaced):
    """The pool of rollout actors could not be placed in time: the message is one line naming train.rollout.actors.
    A restart would wait the same, so the run stops (raytrain/faults.py: failure_callback)."""


class ActorRollout(RolloutEngine):
    """The engine of ``rollout: actors`` on one training rank (see the module docstring)."""

    def __init__(self, cfg, rank: int, world: int, constrained_by=None):
        self.cfg, self.r, self.rank, self.world = cfg, cfg.train.rollout, rank, world
        # the run's tokenizer for the actors' grammar compilers, when the stage constrains its rollouts
        self.tokenizer = (constrained_by.to_json(), constrained_by.eos_id) if constrained_by else None
        self.version: Optional[int] = None
        self.copies: Dict[int, dict] = {}  # version -> this rank's CPU copy of the weights (for a recreated actor)
        self.refs: Dict[int, object] = {}  # version -> rank 0's ObjectRef (kept alive while in flight)
        self.calls = 0
        self.recreated = 0
        self.actors = [self._actor(i) for i in range(self.r.actors)]
        self._wait_placed()

    def _wait_placed(self) -> None:
        """Every actor started within train.rollout.placement_timeout_s; else one line, instead of an actor left
        pending for ever (PENDING_CREATION) on a cluster short of what it asks."""
        import ray

        r = self.r
        _, pending = ray.wait([a.pid.remote() for a in self.actors], num_returns=len(self.actors),
                              timeout=r.placement_timeout_s)
        if pending:
            raise RolloutActorsNotPlaced(
                f"train.rollout.actors: {len(pending)} of {r.actors} rollout actor(s) of {r.actor_cpus:g} CPU / "
                f"{r.actor_gpus:g} GPU each could not be placed within {r.placement_timeout_s:g} s "
                f"(train.rollout.placement_timeout_s); the cluster has no room for them beside the workers: lower "
                f"train.rollout.actors or actor_cpus/actor_gpus, use train.rollout.engine=worker, or add nodes")

    def _actor(self, index: int):
        import dataclasses

        import ray

        remote = ray.remote(RolloutActor).options(
            name=actor_name(self.cfg.name, index), get_if_exists=True, num_cpus=self.r.actor_cpus,
            num_gpus=self.r.actor_gpus, max_concurrency=4 * self.world + 4, max_restarts=0)
        return remote.remote(dataclasses.asdict(self.cfg.model), max(1, int(self.r.actor_cpus)), self.r.prefix_cache_mb,
                             self.tokenizer)

    def update_policy(self, model: torch.nn.Module, step: int) -> None:
        """Weights for requests of version ``step`` (the policy before step ``step``'s update)."""
        import ray

        if self.version == step:
            return
        self.version, self.calls = step, 0
        self.copies[step] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        for old in sorted(self.copies)[:-2]:
            self.copies.pop(old)
            self.refs.pop(old, None)
        if self.rank == 0:
            self.refs[step] = ray.put(self.copies[step])
            for index, done in enumerate([a.load.remote(step, self.refs[step]) for a in self.actors]):
                try:
                    ray.get(done)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    self._recreate(index, step)

    def submit(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seeds: Tensor):
        """Send one request to its actor; :meth:`collect` waits for it (and sends it again if the actor died)."""
        index = (self.rank + self.calls * self.world) % len(self.actors)
        self.calls += 1
        args = (self.version, prompt_ids.cpu(), prompt_mask.cpu(), params, seeds.cpu())
        return index, args, self.actors[index].generate.remote(*args), prompt_ids.device

    def collect(self, handle) -> Rollout:
        import ray

        index, args, ref, device = handle
        for attempt in range(3):
            try:
                roll = ray.get(ref)
                return Rollout(*(t.to(device) for t in (roll.completion_ids, roll.completion_mask, roll.logprobs,
                                                        roll.truncated)))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if attempt == 2:
                    raise RuntimeError(f"rollout actor {actor_name(self.cfg.name, index)} failed 3 times: {e}") from e
                print(f"[minimind-ray] rollout actor {index} lost ({type(e).__name__}); creating it again and "
                      f"retrying the request", flush=True)
                self._recreate(index, args[0])
                ref = self.actors[index].generate.remote(*args)

    def _recreate(self, index: int, version: int) -> None:
        """The actor under its name again (another rank may have made it already), with ``version``'s weights."""
        import ray

        self.actors[index] = self._actor(index)
        self.recreated += 1
        if not ray.get(self.actors[index].has.remote(version)):
            ray.get(self.actors[index].load.remote(version, ray.put(self.copies[version])))

    def generate_many(self, requests) -> list:
        """The requests as one (rollout.merge_requests, one actor), exactly as the in-worker sampler batches them,
        so that the pool samples what a worker would; else each to its actor, all sent before any is awaited."""
        merged = merge_requests(requests, self.cfg.model.max_position_embeddings)
        if merged is None:
            return [self.collect(handle) for handle in [self.submit(*request) for request in requests]]
        return split_rollout(self.collect(self.submit(*merged)), [r[0].shape[0] for r in requests])

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 generator: Optional[torch.Generator] = None, seeds: Optional[Tensor] = None) -> Rollout:
        if seeds is None:
            raise ValueError("rollout actors sample from per-row seeds (rollout.row_seeds)")
        return self.collect(self.submit(prompt_ids, prompt_mask, params, seeds))
