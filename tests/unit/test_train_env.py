"""The Ray Train settings a run puts in its driver's environment while it trains (raytrain/session.py:train_env),
which Ray Train hands on to the controller and the workers however the run reaches Ray, a submitted job included: the
worker-group start timeout is the run's cluster.resource_timeout_s, a value the user exported wins, and afterwards the
environment is as it was (a pipeline's next stage, or a process the program starts later, sees no leftover)."""
from __future__ import annotations

import os

import pytest

from minimind_ray.config import load_config
from minimind_ray.raytrain.session import train_env

START, HEALTH = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
CALLBACKS, GUARD = "RAY_TRAIN_CALLBACKS", "minimind_ray.raytrain.start_guard.StartGuard"


@pytest.fixture
def clean_env(monkeypatch):
    for k in (START, HEALTH, CALLBACKS, WATCHER):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def _cfg(timeout, *over):
    return load_config("pipelines/configs/tiny.yaml", [f"cluster.resource_timeout_s={timeout}", *over])


def test_while_it_trains_the_run_sets_its_resource_timeout_and_a_half_second_poll(clean_env):
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    with train_env(_cfg(20)) as applied:
        assert applied == {HEALTH: "0.5", START: "20", CALLBACKS: GUARD}
        assert (os.environ[START], os.environ[HEALTH]) == ("20", "0.5")
        # what Ray Train itself hands from the driver to its controller and workers
        assert {START: "20", HEALTH: "0.5"}.items() <= get_env_vars_to_propagate().items()
    assert START not in os.environ and HEALTH not in os.environ and CALLBACKS not in os.environ
    with train_env(_cfg(2.5)) as applied:  # the next run of this process: its own value, fractions kept
        assert applied[START] == "2.5"


def test_a_value_the_user_exported_wins_and_stays(clean_env):
    clean_env.setenv(START, "120")
    clean_env.setenv(HEALTH, "0.25")
    clean_env.setenv(CALLBACKS, "mine.Callback")
    with train_env(_cfg(20)) as applied:
        # the user's own Ray Train callbacks stay, after the start guard, which must see a group before Ray's own do
        assert applied == {HEALTH: "0.25", START: "120", CALLBACKS: f"{GUARD},mine.Callback"}
    assert (os.environ[START], os.environ[HEALTH], os.environ[CALLBACKS]) == ("120", "0.25", "mine.Callback")


def test_ray_train_puts_the_start_guard_before_its_own_callbacks(clean_env, tmp_path):
    """The callbacks a TorchTrainer hands its controller, built as fit() builds them: the guard comes before the
    backend's set-up, which is how it sees a group before that set-up can fail (raytrain/restarts.py)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1),
                           run_config=RunConfig(name="guard", storage_path=str(tmp_path)))
    with train_env(_cfg(20)):
        names = [type(c).__name__ for c in trainer._create_default_callbacks()]
    assert names.index("StartGuard") == 0 and "BackendSetupCallback" in names


def test_with_preemption_checks_off_ray_train_starts_no_preemption_watcher(clean_env):
    """checkpoint.preemption_check_interval=0: no rank asks for a drain notice, so the run tells Ray Train (whose
    controller reads the setting it propagates) not to start the PreemptionWatcher actor; by default it is left on."""
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    with train_env(_cfg(20)) as applied:
        assert WATCHER not in applied and WATCHER not in os.environ  # the default: every log interval, watched
    with train_env(_cfg(20, "checkpoint.preemption_check_interval=0")) as applied:
        assert applied[WATCHER] == "0" and get_env_vars_to_propagate()[WATCHER] == "0"
    assert WATCHER not in os.environ
    clean_env.setenv(WATCHER, "1")  # what the user exported wins, as for the other settings
    with train_env(_cfg(20, "checkpoint.preemption_check_interval=0")) as applied:
        assert applied[WATCHER] == "1"


def test_the_trainer_starts_ray_datas_dataset_manager_only_when_given_datasets():
    """raytrain/trainer.py: the workers read the prepared Parquet themselves, so a run's trainer leaves out the
    callback that starts a DatasetManager actor for every worker group; a trainer given datasets keeps it."""
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks import BackendSetupCallback, DatasetsCallback

    from minimind_ray.raytrain.trainer import LeanTorchTrainer

    def kinds(**datasets):
        trainer = LeanTorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1), datasets=datasets)
        return {type(c) for c in trainer._create_default_callbacks()}

    assert BackendSetupCallback in kinds() and DatasetsCallback not in kinds()
    assert DatasetsCallback in kinds(train=lambda: None)
