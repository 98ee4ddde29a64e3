"""MLflow tracking: one MLflow run per training run, logged by rank 0 (and the validation task, by run id).

- :mod:`~minimind_ray.tracking.config`: the ``tracking:`` section.
- :mod:`~minimind_ray.tracking.names`: metric names, grouped as train/, eval/, rl/, perf/, sys/.
- :mod:`~minimind_ray.tracking.parents`: a sweep's or pipeline's parent run, its children's tags, a registered
  version with its lineage.
- :mod:`~minimind_ray.tracking.runs`: where runs live (the tracking URI) and their lifecycle on
  the driver: create, or reopen on a resume; finish.
- :mod:`~minimind_ray.tracking.logger`: :class:`~minimind_ray.tracking.logger.RunLogger`, rank 0's
  background metric logger (never blocks training, never logs a step twice).
- :mod:`~minimind_ray.tracking.artifacts`: after training, the model files, the loss plot and a
  registered model version; :mod:`~minimind_ray.tracking.models`: the weights as the run's MLflow logged model;
  :mod:`~minimind_ray.tracking.datasets`: the prepared data as the run's dataset input;
  :mod:`~minimind_ray.tracking.ui`: the run's chart view, the loss first.
"""
