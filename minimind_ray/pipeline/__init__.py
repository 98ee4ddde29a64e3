"""``minimind-ray pipeline``: stages from data to a served model as one resumable job (docs/pipeline.md).

- :mod:`~minimind_ray.pipeline.config`: the pipeline YAML (stages, their recipes and overrides), checked.
- :mod:`~minimind_ray.pipeline.run`: the stages in order, each finished one recorded; a rerun skips those.
- :mod:`~minimind_ray.pipeline.pipeline_verb`: the command.
"""
