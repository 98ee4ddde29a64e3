"""The cluster recipes under cluster/ are consistent with the repo and with each other.

Fast and without a Ray cluster: YAML parsing, cross-references (the RayJob's module and
config exist, its overrides are real config fields, the shared volume is mounted at
the same path everywhere and is the checkpoint storage), NCCL settings, and that no
dashboard, job server or MLflow server is exposed without a word about it.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
KUBERAY = CLUSTER / "kuberay"
NCCL_VARS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "NCCL_ASYNC_ERROR_HANDLING")


def _docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _kind(kind: str) -> tuple[Path, dict]:
    found = [(p, d) for p in sorted(KUBERAY.glob("*.yaml")) for d in _docs(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} under {KUBERAY}, found {[str(p) for p, _ in found]}"
    return found[0]


def _rayjob_argv() -> list[str]:
    _, job = _kind("RayJob")
    return shlex.split(job["spec"]["entrypoint"])


def _overrides(argv: list[str]) -> list[str]:
    """The dotted key=value overrides after `--config FILE`."""
    i = argv.index("--config")
    return [a for a in argv[i + 2:] if "=" in a and not a.startswith("-")]


def _ray_pods(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    pods = [("head", spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    return pods


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _all_yaml() -> list[Path]:
    return sorted(p for p in CLUSTER.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_every_yaml_under_cluster_parses():
    files = _all_yaml()
    assert len(files) >= 7, files  # kuberay x4+, launcher, runtime envs
    for path in files:
        docs = _docs(path)
        assert docs, f"{path} has no YAML document"
        for d in docs:
            assert isinstance(d, dict), f"{path}: a document is {type(d).__name__}, not a mapping"


def test_local_scripts_are_valid_bash():
    scripts = sorted((CLUSTER / "local").glob("*.sh"))
    assert {p.name for p in scripts} >= {"start.sh", "stop.sh", "kill_node.sh"}
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s}: {r.stderr}"


def test_rayjob_entrypoint_names_a_pipeline_and_config_in_the_repo():
    argv = _rayjob_argv()
    assert argv[:2] == ["python", "-m"], argv
    module = argv[2]
    assert module.startswith("pipelines."), module
    stage_file = REPO / (module.replace(".", "/") + ".py")
    assert stage_file.is_file(), f"the RayJob runs {module}, but {stage_file.relative_to(REPO)} does not exist"
    config = argv[argv.index("--config") + 1]
    assert (REPO / config).is_file(), f"the RayJob's --config {config} does not exist in the repo"


def test_rayjob_overrides_are_config_fields():
    """Each `key=value` of the entrypoint merges into the typed config (no typo'd keys).

    Not `load_config`: its validation checks that /mnt/shared paths exist, which they
    only do in the pods."""
    from omegaconf import OmegaConf

    from minimind_ray.config import RunConfig

    argv = _rayjob_argv()
    config = REPO / argv[argv.index("--config") + 1]
    if not config.is_file():
        pytest.fail(f"{config.relative_to(REPO)} missing (see the entrypoint test)")
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(config),
                             OmegaConf.from_dotlist(_overrides(argv)))
    cfg = OmegaConf.to_object(merged)
    assert cfg.cluster.worker_resource == "trainslot"


def test_rayjob_runtime_env_ships_code_and_env_not_pip():
    _, job = _kind("RayJob")
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert env.get("working_dir"), "the RayJob's runtimeEnvYAML needs a working_dir"
    assert env.get("env_vars"), "the RayJob's runtimeEnvYAML should set env vars"
    assert all(isinstance(v, str) for v in env["env_vars"].values()), "runtime_env env_vars must be strings"
    assert "pip" not in env and "conda" not in env, "dependencies belong in the image, not the runtime env"


def test_rayjob_targets_the_raycluster():
    _, job = _kind("RayJob")
    _, cluster = _kind("RayCluster")
    sel = job["spec"].get("clusterSelector")
    if sel is not None:
        assert sel.get("ray.io/cluster") == cluster["metadata"]["name"]
    else:
        assert "rayClusterSpec" in job["spec"]


def test_shared_volume_mounted_everywhere_at_the_storage_path():
    _, cluster = _kind("RayCluster")
    claims = {d["metadata"]["name"]: d for p in KUBERAY.glob("*.yaml") for d in _docs(p)
              if d.get("kind") == "PersistentVolumeClaim"}
    paths = {}
    for name, pod in _ray_pods(cluster):
        shared = [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
        assert len(shared) == 1, f"{name}: expected one PVC volume, got {shared}"
        vol = shared[0]
        claim = vol["persistentVolumeClaim"]["claimName"]
        assert claim in claims, f"{name} mounts claim {claim!r}, which no YAML under cluster/kuberay defines"
        assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"], \
            f"claim {claim} must be ReadWriteMany: all Ray pods write checkpoints to it at once"
        mounts = [m["mountPath"] for m in pod["containers"][0].get("volumeMounts", []) if m["name"] == vol["name"]]
        assert len(mounts) == 1, f"{name}: the shared volume is not mounted in the Ray container"
        paths[name] = mounts[0]
    assert len(set(paths.values())) == 1, f"the shared volume must be mounted at one path everywhere: {paths}"
    mount = next(iter(paths.values())).rstrip("/")

    over = dict(o.split("=", 1) for o in _overrides(_rayjob_argv()))
    storage = over.get("checkpoint.storage_path")
    assert storage, "the RayJob must set checkpoint.storage_path to the shared mount"
    assert storage == mount or storage.startswith(mount + "/"), \
        f"checkpoint.storage_path={storage} is not on the shared mount {mount}"


def test_gpu_workers_have_gpus_trainslot_and_nccl_env():
    path, cluster = _kind("RayCluster")
    text = path.read_text()
    groups = cluster["spec"]["workerGroupSpecs"]
    assert groups
    for g in groups:
        c = g["template"]["spec"]["containers"][0]
        limits = c["resources"]["limits"]
        assert int(limits.get("nvidia.com/gpu", 0)) >= 1, f"{g['groupName']}: no nvidia.com/gpu limit"
        assert "cpu" in limits and "memory" in limits, f"{g['groupName']}: set CPU and memory"
        assert "trainslot" in g["rayStartParams"].get("resources", ""), \
            f"{g['groupName']}: each GPU pod should offer one trainslot"
        env = _env(c)
        missing = [v for v in NCCL_VARS if v not in env]
        assert not missing, f"{g['groupName']}: NCCL env vars missing: {missing}"
        assert env["NCCL_DEBUG"] == "WARN"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # each NCCL variable is explained: a comment between its `- name:` and the next entry
    for var in NCCL_VARS:
        m = re.search(rf"- name: {var}\n(.*?)(?=\n\s*- name:|\n\s*volumeMounts:)", text, re.S)
        assert m and "#" in m.group(0), f"{var} in {path.name} has no comment explaining it"


def test_mlflow_reachable_in_cluster_only():
    _, cluster = _kind("RayCluster")
    services = {d["metadata"]["name"]: d for p in KUBERAY.glob("*.yaml") for d in _docs(p) if d.get("kind") == "Service"}
    assert "mlflow" in services
    svc = services["mlflow"]
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    port = svc["spec"]["ports"][0]["port"]
    for name, pod in _ray_pods(cluster):
        uri = _env(pod["containers"][0]).get("MLFLOW_TRACKING_URI")
        assert uri, f"{name}: MLFLOW_TRACKING_URI not set"
        assert re.match(rf"http://mlflow(\.[\w.-]+)?:{port}/?$", uri), f"{name}: {uri} is not the mlflow service"


def test_nothing_exposed_publicly_without_a_comment():
    for path in _all_yaml():
        lines = path.read_text().splitlines()
        for d in _docs(path):
            assert d.get("kind") != "Ingress", f"{path}: no Ingress for the dashboard or MLflow"
            if d.get("kind") == "Service":
                assert d["spec"].get("type", "ClusterIP") == "ClusterIP", f"{path}: Service {d['metadata']['name']}"
        # a dashboard bound to all interfaces needs its reason written right above it: who
        # can reach it (ClusterIP / port-forward) or what guards it (auth)
        for i, line in enumerate(lines):
            if re.search(r"dashboard-host[\"']?\s*[:=]\s*[\"']?(0\.0\.0\.0|::)", line):
                above = []
                for prev in reversed(lines[:i]):
                    if not prev.strip().startswith("#"):
                        break
                    above.append(prev)
                comment = " ".join(above) + line.partition("#")[2]
                assert re.search(r"ClusterIP|port-forward|auth", comment, re.I), \
                    f"{path}:{i + 1}: dashboard bound to all interfaces without a comment saying who can reach it"
    _, cluster = _kind("RayCluster")
    assert cluster["spec"]["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    launcher = yaml.safe_load((CLUSTER / "launcher" / "aws.yaml").read_text())
    head_cmds = " ".join(launcher["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds
    assert "--dashboard-host 127.0.0.1" in (CLUSTER / "local" / "start.sh").read_text()


def test_launcher_gpu_workers_trainslot_setup_and_file_mounts():
    cfg = yaml.safe_load((CLUSTER / "launcher" / "aws.yaml").read_text())
    assert cfg["provider"]["type"] == "aws"
    gpu_types = {k: v for k, v in cfg["available_node_types"].items() if v.get("resources", {}).get("GPU")}
    assert gpu_types, "no GPU worker type"
    for name, t in gpu_types.items():
        assert t["resources"].get("trainslot") == 1, f"{name}: one trainslot per GPU node"
    assert any("requirements.txt" in c for c in cfg["setup_commands"])
    assert "." in cfg["file_mounts"].values(), "the repo should be file-mounted"
    # Ray's own schema check (no cluster, no cloud calls)
    util = pytest.importorskip("ray.autoscaler._private.util")
    util.validate_config(util.prepare_config(cfg))


def test_runtime_env_files():
    plain = yaml.safe_load((CLUSTER / "runtime_env.yaml").read_text())
    assert plain["working_dir"] == "." and plain["env_vars"]
    assert "pip" not in plain
    pip_path = CLUSTER / "runtime_env.pip.yaml"
    with_pip = yaml.safe_load(pip_path.read_text())
    assert with_pip["pip"] == "requirements.txt" and (REPO / "requirements.txt").is_file()
    assert "WARNING" in pip_path.read_text()
    from ray.runtime_env import RuntimeEnv  # the same parsing `ray job submit --runtime-env` does

    RuntimeEnv(**{k: v for k, v in plain.items()})
