"""Everything one rank's training depends on, built once and saved/restored as a whole.

:class:`TrainState` holds the model (plain, DDP-wrapped or FSDP-sharded (engine/parallel.py), maybe compiled), the stage
objective, the optimizer, the lr scheduler, the data stream, the step, the RNG, and the models a
stage trains beside the policy with their own optimizers (:class:`TrainedPart`: PPO's critic). Each part
follows the ``state_dict()``/``load_state_dict()`` contract (torchtitan's ``Stateful``), and
:meth:`TrainState.save` / :meth:`TrainState.restore` map them onto the checkpoint layout that
``minimind_ray/store/checkpoint.py`` owns. No Ray here: a world of 1 needs no process group,
and a larger world needs only ``torch.distributed`` initialised (Ray Train does it, as
``torchrun`` would).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from minimind_ray.cluster_config import worker_threads
from minimind_ray.engine.metrics import CommTimer
from minimind_ray.engine.parallel import (checkpoint_blocks, load_sharded_state, load_whole_state, shard_model,
                                          sharded_state)
from minimind_ray.engine.step import autocast_for, bf16_compute, lr_lambda
from minimind_ray.failures import reading
from minimind_ray.model.minimind import build_model
from minimind_ray.stages import get_stage
from minimind_ray.stages.objective import Objective


class RNGState:
    """The process's random state: torch CPU, this rank's CUDA device, Python's ``random``."""

    def state_dict(self) -> Dict[str, Any]:
        py = random.getstate()
        state = {"torch": torch.get_rng_state(), "python": list(py[1]), "python_version": py[0],
                 "python_gauss": py[2]}
        if torch.cuda.is_available():  # this rank's device only: a restart may see a different set of GPUs
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


@dataclass
class TrainedPart:
    """A model trained beside the policy (PPO's critic, ``Objective.trained_parts``): its own DDP wrapper, AdamW
    with its own lr, the policy's lr schedule, gradient clipping on its own; its weights are a file of their own in
    every checkpoint (``<name>.pth``), its optimizer and schedule a section of ``train_state.pt``."""

    model: torch.nn.Module
    ddp_model: torch.nn.Module
    params: List[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @classmethod
    def build(cls, module, lr: float, cfg, world: int, device, total_steps: int, comm) -> "TrainedPart":
        from torch.nn.parallel import DistributedDataParallel as DDP

        t = cfg.train
        module.to(device)
        ddp = module
        if world > 1:
            ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                      forward_sync_buffers=False, gradient_as_bucket_view=True)
            ddp.register_comm_hook(None, comm.hook)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t, total_steps))
        return cls(module, ddp, params, optimizer, scheduler)

    def train_state(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load(self, model_state: Dict[str, Any], train_state: Dict[str, Any]) -> None:
        self.model.load_state_dict(model_state, strict=True)
        self.optimizer.load_state_dict(train_state["optimizer"])
        self.scheduler.load_state_dict(train_state["scheduler"])


@dataclass
class TrainState:
    cfg: Any  # the run's RunConfig (minimind_ray/config.py)
    rank: int
    world: int
    device: torch.device
    model: torch.nn.Module  # the plain model (sharded in place under FSDP): what checkpoints and exports hold
    ddp_model: torch.nn.Module  # DDP-wrapped when world > 1 under ddp, else ``model``
    forward_model: Callable  # ``ddp_model``, compiled when train.compile
    objective: Objective
    params: List[torch.nn.Parameter]  # the trained ones
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: Any  # data.stream.PreparedDataset
    stream: Any  # data.stream.TrainStream: this rank's batches
    total_steps: int
    autocast: Callable
    comm: Optional[CommTimer] = None
    step: int = 0  # optimizer steps done
    rng: RNGState = field(default_factory=RNGState)
    parts: Dict[str, TrainedPart] = field(default_factory=dict)  # models trained beside the policy (PPO's critic)
    sharded: bool = False  # FSDP: weights, gradients and AdamW sharded over the ranks; checkpoints sharded (DCP)
    stage: Any = None  # the run's stage record (stages/stage.py:Stage), set by build

    def adapters(self) -> Optional[Dict[str, Any]]:
        """The LoRA adapters the run's stage puts on the model (its record's ``adapters``), as a checkpoint records
        them; None: none."""
        lora = self.stage.adapters(self.cfg)
        return dataclasses.asdict(lora) if lora is not None else None

    @classmethod
    def build(cls, cfg, prepared_dir: str, rank: int = 0, world: int = 1,
              device: Optional[torch.device] = None, stage=None) -> "TrainState":
        """A fresh state at step 0. The order matters for exact restarts: the model init is seeded
        on its own; dropout and sampling then draw from ``seed + rank``. ``stage``: the run's stage record as the
        driver resolved it (a worker's WorkerSpec.stage); None: the one ``cfg.train.stage`` names."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from minimind_ray.data.stream import PreparedDataset, TrainStream  # lazy: numpy, pyarrow, only when this runs
        from minimind_ray.store.weights import load_model_weights  # lazy: pyarrow, only when this runs

        device = device or torch.device("cpu")
        torch.set_num_threads(worker_threads(cfg))
        t = cfg.train
        model = build_model(cfg.model, seed=t.seed)  # the same init on every rank (build_model forks the RNG)
        torch.manual_seed(t.seed + rank)  # dropout and sampling differ per rank
        random.seed(t.seed + rank)
        stage = stage if stage is not None else get_stage(cfg.train.stage)
        objective = stage.objective(cfg)
        if t.init_from:  # also on restore: DPO's reference is a copy of the *initial* weights
            with reading(f"train.init_from={t.init_from}"):
                load_model_weights(model, t.init_from, strict=True)
        objective.setup(model, device)  # freezes / builds frozen models from the initial weights
        sharded = t.parallelism == "fsdp" and dist.is_available() and dist.is_initialized()  # one rank too (Ray Train)
        if not sharded:  # FSDP moves each block to the device as it shards it: the GPU never holds the whole model
            model.to(device)
        if t.activation_checkpointing == "blocks":
            checkpoint_blocks(model)
        ddp_model, comm, autocast = model, None, autocast_for(t.precision, device)
        if sharded:  # in place; bf16 comes from the sharding's mixed-precision policy, not autocast
            shard_model(model, device, world, bf16_compute(t.precision, device), t.reshard_after_forward, t.compile)
            autocast = contextlib.nullcontext
        elif world > 1:
            ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                            forward_sync_buffers=False, gradient_as_bucket_view=True)  # RoPE tables are equal on all ranks
            comm = CommTimer()
            ddp_model.register_comm_hook(None, comm.hook)
        forward_model = torch.compile(ddp_model) if t.compile and not sharded else ddp_model
        params = [p for p in model.parameters() if p.requires_grad]  # after sharding: the DTensor shards
        optimizer = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

        with reading(f"the prepared data {prepared_dir}"):
            dataset = PreparedDataset(prepared_dir, eval_fraction=cfg.data.eval_fraction)
        stream = TrainStream(dataset, split="train", global_batch_size=t.global_batch_size,
                             micro_batch_size=t.micro_batch_size, world_size=world, rank=rank, seed=t.seed,
                             shuffle=cfg.data.shuffle, shuffle_window_blocks=cfg.data.shuffle_window_blocks,
                             prefetch_steps=cfg.data.prefetch_steps)
        total_steps = t.max_steps or t.epochs * stream.steps_per_epoch
        if total_steps <= 0:
            raise ValueError(f"{prepared_dir}: {dataset.num_sequences('train')} training sequences "
                             f"make no full global batch of {t.global_batch_size}")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t, total_steps))
        parts = {name: TrainedPart.build(module, lr, cfg, world, device, total_steps, comm)
                 for name, (module, lr) in objective.trained_parts().items()}
        objective.bind_parts({name: part.ddp_model for name, part in parts.items()})
        return cls(cfg=cfg, rank=rank, world=world, device=device, model=model, ddp_model=ddp_model,
                   forward_model=forward_model, objective=objective, params=params, optimizer=optimizer,
                   scheduler=scheduler, dataset=dataset, stream=stream, total_steps=total_steps,
                   autocast=autocast, comm=comm, parts=parts, sharded=sharded, stage=stage)

    # ---- Stateful

    def _weights(self) -> Dict[str, Any]:
        """The model and AdamW: as they are under DDP (AdamW keyed by parameter index); under FSDP keyed by name,
        this rank's slices (``by_name``: what a sharded checkpoint holds, engine/parallel.py:sharded_state)."""
        if self.sharded:
            return {**sharded_state(self.model, self.optimizer), "by_name": True}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def state_dict(self) -> Dict[str, Any]:
        sd = {**self._weights(), "scheduler": self.scheduler.state_dict(), "data": self.stream.state_dict(),
              "step": self.step, "rng": self.rng.state_dict(), "objective": self.objective.state_dict()}
        if self.parts:  # only stages that train a second model have the key: the others' state is as before
            sd["parts"] = {n: {"model": p.model.state_dict(), **p.train_state()} for n, p in self.parts.items()}
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        from minimind_ray.store.pth import load_pth  # lazy: pyarrow, only when this runs

        if sd.get("by_name"):  # a sharded checkpoint's form (filled with this rank's slices, or whole tensors)
            load_sharded_state(self.model, self.optimizer, sd)
        elif self.sharded:  # a DDP checkpoint into FSDP: each rank keeps its slices of the whole tensors
            load_whole_state(self.model, self.optimizer, self.params, sd["model"], sd["optimizer"])
        else:
            load_pth(self.model, sd["model"], strict=True)
            self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.stream.load_state_dict(sd["data"])
        self.step = int(sd["step"])
        if sd.get("rng") is not None:  # a checkpoint of a smaller world has none for this rank
            self.rng.load_state_dict(sd["rng"])
        self.objective.load_state_dict(sd.get("objective") or {})  # older checkpoints: none
        for name, part in self.parts.items():
            if not {"model", "optimizer", "scheduler"} <= set((sd.get("parts") or {}).get(name, {})):
                from minimind_ray.store.checkpoint import CheckpointError  # lazy: pyarrow, only when this runs

                raise CheckpointError(f"the checkpoint holds no {name!r} (a model stage {self.cfg.train.stage!r} "
                                      f"trains beside the policy); it was not written by this stage")
            part.load(sd["parts"][name]["model"], sd["parts"][name])

    # ---- the checkpoint layout (minimind_ray/store/checkpoint.py)

    def save(self, ckpt_dir, mlflow_run_id: Optional[str], prepared_dir: str,
             reported: Optional[Dict[str, Any]] = None) -> None:
        """Write this rank's part of a checkpoint into a local staging directory (``reported``: the metrics the
        caller hands over with it, kept in meta.json). Every rank calls it (under FSDP each writes its shards, a
        collective)."""
        # lazy: pyarrow, only when this runs
        from minimind_ray.store.checkpoint import CheckpointMeta, write_rank_files, write_shared_files
        from minimind_ray.store.sharded import write_sharded  # lazy: pyarrow, only when this runs

        rank_files = write_rank_files(ckpt_dir, self.rank, self.rng.state_dict())  # every rank's, with sizes
        sharded_files = write_sharded(ckpt_dir, sharded_state(self.model, self.optimizer)) if self.sharded else None
        if self.rank == 0:
            meta = CheckpointMeta(step=self.step, epoch=(self.step - 1) // self.stream.steps_per_epoch,
                                  data_state=self.stream.state_dict(), world_size=self.world,
                                  mlflow_run_id=mlflow_run_id, stage=self.cfg.train.stage,
                                  total_steps=self.total_steps, config=dataclasses.asdict(self.cfg), prepared_dir=prepared_dir,
                                  reported=dict(reported or {}), adapters=self.adapters())
            train_state = {"scheduler": self.scheduler.state_dict(), "objective": self.objective.state_dict()}
            if not self.sharded:  # under FSDP AdamW's moments are in the shards
                train_state = {"optimizer": self.optimizer.state_dict(), **train_state}
            if self.parts:
                train_state["parts"] = {n: p.train_state() for n, p in self.parts.items()}
            write_shared_files(ckpt_dir, model_state=None if self.sharded else self.model.state_dict(),
                               train_state=train_state, meta=meta, sharded_files=sharded_files, rank_files=rank_files,
                               part_states={n: p.model.state_dict() for n, p in self.parts.items()})

    def restore(self, stored):
        """Continue from a verified :class:`~minimind_ray.store.checkpoint.StoredCheckpoint`; returns its
        :class:`~minimind_ray.store.checkpoint.CheckpointMeta`."""
        meta = stored.meta()
        train_state = stored.train_state()
        parts = {n: {"model": stored.part_state(n), **(train_state.get("parts") or {}).get(n, {})}
                 for n in self.parts if stored.has_part(n)}
        if stored.sharded:  # written under FSDP by any number of ranks: DCP reads this rank's slices (or all of it)
            weights = {**sharded_state(self.model, self.optimizer), "by_name": True}
            stored.load_sharded({k: weights[k] for k in ("model", "optimizer")})
        else:
            weights = {"model": stored.model_state(), "optimizer": train_state["optimizer"]}
        self.load_state_dict({**weights, "scheduler": train_state["scheduler"], "data": meta.data_state,
                              "step": meta.step, "rng": stored.rng(self.rank), "objective": train_state.get("objective"),
                              "parts": parts})
        return meta
