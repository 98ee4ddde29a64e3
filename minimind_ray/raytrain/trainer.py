"""The TorchTrainer every run fits: Ray Train's own, less one actor per worker-group start.

Ray Train 2.58 adds a ``DatasetsCallback`` to every trainer, datasets or not (2.60 still does: its
``callbacks/datasets.py`` is 2.58's, line for line), and that callback starts a
``DatasetManager`` actor for every worker group (restarts included): a Ray worker process that imports Ray Data,
about 2 CPU s, and on 2 cores about 1 s of a tiny run's 14 s (measured: ``docs/testing.md``, "Where the suite's
time goes"). The workers here never call ``ray.train.get_dataset_shard``: each reads the prepared Parquet itself
(``data/stream.py``), so a trainer given no datasets drops the callback. Given datasets, it is Ray's trainer as is.

Nor does it take SIGINT: Ray's ``fit`` puts its own handler in (an abort of the controller, which left the workers
training on for seconds and their last checkpoints' uploads cut); the driver's (raytrain/interrupt.py) stays, a
stop at a step boundary on a checkpoint in storage.
"""
from __future__ import annotations

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback  # Ray's own name, 2.58 to 2.60 (pyproject pins the minor)


class LeanTorchTrainer(TorchTrainer):
    """``ray.train.torch.TorchTrainer``, without the DatasetManager actor when it is given no datasets."""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    def _register_sigint_handler(self, controller):
        """Ray's abort on Ctrl-C, left out: raytrain/interrupt.py's handler is in place while the run fits."""
