"""One rank's training, with no Ray import.

- :mod:`~minimind_ray.engine.config`: the ``train:`` section (the loop, and each stage's section from its record),
  the schedule of checkpoints and validations. Light: the config reads it, so this package imports nothing by itself.
- :mod:`~minimind_ray.engine.state`: :class:`TrainState`, every part a step depends on, Stateful.
- :mod:`~minimind_ray.engine.step`: :func:`train_step`, one optimizer step (micro-steps, ``no_sync``,
  the token-weighted global loss, clip, AdamW, scheduler).
- :mod:`~minimind_ray.engine.loop`: :func:`run`, the loop over steps with :class:`Hooks` for whoever drives it.
- :mod:`~minimind_ray.engine.metrics`: interval metrics, MFU, all-reduce timing; :mod:`~minimind_ray.engine.evaluate`:
  held-out loss; :mod:`~minimind_ray.engine.memory`: one worker's peak memory by estimate.
  The stages' objectives are in minimind_ray/stages/.

A world of 1 needs no process group; a larger one needs ``torch.distributed`` initialised by
whoever starts the ranks (Ray Train in minimind_ray/raytrain, or ``torchrun``).
"""
