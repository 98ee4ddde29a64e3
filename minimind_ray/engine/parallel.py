"""How the workers share the model (``train.parallelism``), and activation checkpointing: the one place that wraps a
model for training. The state (engine/state.py) calls it; a stage never chooses a wrapper.

    ddp    DistributedDataParallel: a whole copy of the weights, gradients and AdamW moments on every worker;
           gradients all-reduced once per optimizer step (no_sync on the step's other micro-batches)
    fsdp   FSDP2 (``torch.distributed.fsdp.fully_shard``) on each transformer block, then on the root (the embedding,
           tied to lm_head, and the final norm): a worker keeps 1/world of every weight, gradient and AdamW moment
           (DTensors sharded on dim 0); a block's weights are all-gathered just before it runs and freed after it
           (``train.reshard_after_forward``), its gradients reduce-scattered as backward leaves it, on every
           micro-batch (skipping that would hold whole gradients, the memory FSDP is there to save)
    one worker: under ddp the plain model; under fsdp a process group of one (a Ray Train run of one worker) is
           sharded over its one rank (no memory saved, the same code path: bf16 weights on a GPU, a sharded
           checkpoint), and one process with no process group (the engine alone: tests, benchmarks) is the plain model

FSDP2 keeps the tie: the embedding and lm_head are one Parameter, in the root's group, sharded once.

Mixed precision. DDP on a GPU with bf16 runs under bf16 autocast with fp32 weights. FSDP casts the gathered weights to
bf16 instead (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the fp32 shards are the master copy and
gradients are reduced in fp32) and runs without autocast, as torchtitan does. On CPU both are fp32.

Both reduce gradients as a mean over the workers, so the step's ``world / weight`` scaling (engine/step.py) holds for
both: a 1-, 2- or 4-worker run takes the same steps at the same global batch.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, List

import torch
from torch import nn


def checkpoint_blocks(model: nn.Module) -> None:
    """``train.activation_checkpointing=blocks``: each transformer block keeps its input only and runs again in
    backward (``torch.utils.checkpoint``, non-reentrant; the RNG state is restored for the rerun, so dropout draws the
    same masks). The block's ``forward`` is replaced on the instance, not the module wrapped: the state dict keys stay
    MiniMind's, and FSDP's hooks (which run in ``__call__``) gather the weights around the checkpointed forward."""
    from torch.utils.checkpoint import checkpoint

    for block in model.model.layers:
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)


def shard_model(model: nn.Module, device: torch.device, world: int, bf16: bool, reshard_after_forward: bool,
                compile_blocks: bool = False) -> None:
    """FSDP2 in place: each block, then the root. ``bf16``: gathered weights in bf16, gradients reduced in fp32.
    ``compile_blocks`` (train.compile): each block compiled in place before it is sharded (torchtitan's order:
    checkpointing, compile, shard), the root left eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # a block returns its (k, v) for the KV cache, v a view; FSDP warns that an in-place op on a returned view would
    # skip its hook. Training never touches them (nor does anything else: the cache is rebuilt by torch.cat)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    layers = model.model.layers
    for i, block in enumerate(layers):
        if compile_blocks:
            block.compile()
        # the last block's weights are needed again at once, by the first step of backward: keep them
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def clip_sharded_grad_norm(params: List[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` of sharded gradients: their norm is a DTensor, its value all-reduced over the shards,
    made a plain tensor for the metrics; gradients scaled down to ``max_norm`` if above it (inf: none)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# --------------------------------------------------------------------------- state, under either wrapper


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """What a sharded checkpoint holds (torch.distributed.checkpoint): the model and AdamW keyed by parameter name
    (FQN), each rank's shards as DTensors (or whole tensors, unsharded). An optimizer that has not stepped yet gets its
    state made first (a zero step at lr 0), so that a restore has every tensor to load into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Put :func:`sharded_state`'s dict, filled by a checkpoint, into the model and AdamW."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_whole_state(model: nn.Module, optimizer: torch.optim.Optimizer, params: List[nn.Parameter],
                     model_state: Dict[str, torch.Tensor], optimizer_state: Dict[str, Any]) -> None:
    """A DDP checkpoint (whole weights; AdamW's ``state_dict()``, keyed by the index of each trained parameter) into
    a sharded model: each rank keeps its own slice of every tensor."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=whole)
    set_optimizer_state_dict(model, optimizer, by_name(model, params, optimizer_state), options=whole)


def by_name(model: nn.Module, params: List[nn.Parameter], optimizer_state: Dict[str, Any]) -> Dict[str, Any]:
    """AdamW's ``state_dict()`` keyed by parameter index -> keyed by parameter name (what DCP's state-dict helpers
    take). Index i is ``params[i]``, the trained parameters in ``model.parameters()`` order (TrainState.params)."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqn = [names[id(p)] for p in params]
    return {"state": {fqn[i]: s for i, s in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}


def whole_model_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's weights as whole CPU tensors under MiniMind's keys. Sharded, it is a collective (every rank calls
    it) and rank 0 alone gets them (the others an empty dict: one whole copy per machine is enough)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

