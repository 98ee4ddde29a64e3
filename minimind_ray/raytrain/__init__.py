"""The thin Ray layer: the only place that imports ``ray.train``.

- :mod:`~minimind_ray.raytrain.driver`: :func:`~minimind_ray.raytrain.driver.run`, one training run
  end to end (connect, resources, prepare, tracking, ``TorchTrainer``, exports).
- :mod:`~minimind_ray.raytrain.spec`: :class:`~minimind_ray.raytrain.spec.WorkerSpec`, the one frozen
  hand-off from the driver to the workers.
- :mod:`~minimind_ray.raytrain.worker`: ``train_loop_per_worker``: restore, loop the engine, report.
- :mod:`~minimind_ray.raytrain.progress`: the progress actor and the driver's console view.
- :mod:`~minimind_ray.raytrain.faults`: fault injection and the sample log (for recovery tests and benchmarks).
- the verbs: :mod:`~minimind_ray.raytrain.train_verb` (one per stage, and a finished run's summary),
  :mod:`~minimind_ray.raytrain.prepare_verb`, :mod:`~minimind_ray.raytrain.sweep_verb`.
"""
