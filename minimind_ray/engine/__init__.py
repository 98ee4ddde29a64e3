"""One rank's training, with no Ray import.

- :mod:`~minimind_ray.engine.state`: :class:`TrainState`, every part a step depends on, Stateful.
- :mod:`~minimind_ray.engine.step`: :func:`train_step`, one optimizer step (micro-steps, ``no_sync``,
  the token-weighted global loss, clip, AdamW, scheduler).
- :mod:`~minimind_ray.engine.loop`: :func:`run`, the loop over steps with :class:`Hooks` for whoever drives it.
- :mod:`~minimind_ray.engine.objectives`: the stage plug-ins; :mod:`~minimind_ray.engine.metrics`:
  interval metrics, MFU, all-reduce timing; :mod:`~minimind_ray.engine.evaluate`: held-out loss.

A world of 1 needs no process group; a larger one needs ``torch.distributed`` initialised by
whoever starts the ranks (Ray Train in minimind_ray/raytrain, or ``torchrun``).
"""
from minimind_ray.engine.loop import Hooks, run
from minimind_ray.engine.state import TrainState
from minimind_ray.engine.step import train_step

__all__ = ["Hooks", "TrainState", "run", "train_step"]
