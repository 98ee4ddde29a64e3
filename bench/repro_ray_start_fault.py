"""Ray Train 2.58 alone (no minimind-ray code): a worker that dies while the worker group starts.

    .venv/bin/python bench/repro_ray_start_fault.py backend   # the run hangs: every later start times out
    .venv/bin/python bench/repro_ray_start_fault.py launch    # the run ends, although max_failures=3

A 2-worker TorchTrainer on a 3-CPU local Ray, FailureConfig(max_failures=3). Rank 1's process SIGKILLs itself once:
* ``backend``: inside the torch backend's ``on_start`` (an ``after_worker_group_start`` callback). The group's state is
  already built, so ``WorkerGroup._start`` skips its clean-up and the controller never holds the group: its placement
  group (2 CPUs) stays. Each later start waits for 2 CPUs with 1 free and times out
  (``WorkerGroupStartupTimeoutError``), retried without end as a controller failure (``controller_failure_limit``
  defaults to -1). After 60 s the script prints the placement groups and the free CPUs, and exits 3.
* ``launch``: while ``run_train_fn`` unpickles the train function's config. The bare ``ActorDiedError`` of
  ``_start_impl``'s last ``ray.get`` is neither a ``WorkerGroupError`` nor a retryable controller error: the run
  fails at once.

Expected of both: one restart counted against ``max_failures``, then training. minimind-ray's workaround:
minimind_ray/raytrain/restarts.py and start_guard.py; docs/reliability.md, "A worker lost while the group starts".
"""
import os
import signal
import sys
import tempfile
import threading
import time

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _TorchBackend

MODE = sys.argv[1] if len(sys.argv) > 1 else "backend"
FIRED = os.path.join(tempfile.mkdtemp(), "fired")  # once per run, across restarts


def die_once():
    if not os.path.exists(FIRED):
        open(FIRED, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


class KillingBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config):
        if MODE == "backend":
            worker_group.execute_single(1, die_once)
        super().on_start(worker_group, backend_config)


class KillingTorchConfig(TorchConfig):
    @property
    def backend_cls(self):
        return KillingBackend


def _on_unpickle():
    try:
        rank = ray.train.get_context().get_world_rank()
    except Exception:  # the driver and the controller unpickle the config too
        return None
    if MODE == "launch" and rank == 1:
        die_once()
    return None


class DieOnUnpickle:
    def __reduce__(self):
        return _on_unpickle, ()


def train_fn(config):
    import torch.distributed as dist

    dist.barrier()


def show_and_exit():
    print("HUNG: fit() has not returned after 60 s", flush=True)
    for pg_id, t in ray.util.placement_group_table().items():
        print(f"placement group {pg_id}: {t['state']} bundles {t['bundles']}", flush=True)
    print(f"free CPUs {ray.available_resources().get('CPU', 0)} of {ray.cluster_resources().get('CPU')}", flush=True)
    os._exit(3)


if __name__ == "__main__":
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "10"
    ray.init(num_cpus=3, include_dashboard=False)
    threading.Timer(60, show_and_exit).start()
    t0 = time.time()
    trainer = TorchTrainer(train_fn, train_loop_config={"x": DieOnUnpickle()},
                           torch_config=KillingTorchConfig(backend="gloo"),
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(name=f"repro-{MODE}", storage_path=tempfile.mkdtemp(),
                                                failure_config=FailureConfig(max_failures=3)))
    try:
        trainer.fit()
        print(f"FINISHED in {time.time() - t0:.1f} s", flush=True)
    except Exception as e:
        print(f"FAILED in {time.time() - t0:.1f} s: {type(e).__name__}: {str(e)[:300]}", flush=True)
    os._exit(0)
