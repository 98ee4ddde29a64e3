"""The cluster recipes under cluster/ are consistent with the repo and with each other.

Fast and without a Ray cluster: YAML parsing, cross-references (the RayJob's module and
config exist, its overrides are real config fields, the shared volume is mounted at
the same path everywhere and is the checkpoint storage), NCCL settings, and that no
dashboard, job server or MLflow server is exposed without a word about it.
"""
from __future__ import annotations

import functools
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


# ---- hardening: securityContext on every pod, NetworkPolicy, token auth ----------------

NAMESPACE_LABELS = {"kubernetes.io/metadata.name": "default"}   # the namespace the manifests are applied in
# The kernel's ephemeral port range (net.ipv4.ip_local_port_range): torch.distributed's
# MASTER_PORT (Ray Train binds port 0) and NCCL/gloo connections come from it.
EPHEMERAL = (32768, 60999)
# rayStartParams that pin a listening port, on every Ray pod / on the head only
NODE_PORT_PARAMS = ("node-manager-port", "object-manager-port", "runtime-env-agent-port",
                    "dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
                    "min-worker-port", "max-worker-port")
HEAD_PORT_PARAMS = ("port", "dashboard-port")


def _pod_specs() -> list[tuple[str, dict | None]]:
    """(name, pod spec) of every pod the manifests make; None where the operator would build
    the pod itself (a K8sJobMode RayJob without submitterPodTemplate)."""
    pods = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        for d in _docs(path):
            kind, name, spec = d.get("kind"), f"{path.name}:{d['metadata']['name']}", d.get("spec", {})
            if kind == "Pod":
                pods.append((name, spec))
            elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
                pods.append((name, spec["template"]["spec"]))
            elif kind == "RayCluster":
                pods += [(f"{name}/{g}", p) for g, p in _ray_pods(d)]
            elif kind == "RayService":
                pods += [(f"{name}/{g}", p) for g, p in _ray_pods({"spec": spec["rayClusterConfig"]})]
            elif kind == "RayJob":
                if "rayClusterSpec" in spec:
                    pods += [(f"{name}/{g}", p) for g, p in _ray_pods({"spec": spec["rayClusterSpec"]})]
                if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
                    pods.append((f"{name}/submitter", (spec.get("submitterPodTemplate") or {}).get("spec")))
    return pods


def _check_container_security(where: str, sc: dict, pod_sc: dict) -> None:
    assert sc, f"{where}: no container securityContext"
    assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot must be true"
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    # the kubelet can only enforce runAsNonRoot against a numeric uid
    assert isinstance(uid, int) and uid > 0, f"{where}: runAsUser must be a non-zero number, got {uid!r}"
    assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation must be false"
    assert not sc.get("privileged"), f"{where}: privileged"
    caps = sc.get("capabilities") or {}
    assert caps.get("drop") == ["ALL"] and not caps.get("add"), f"{where}: capabilities must drop ALL, add none: {caps}"
    assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{where}: seccompProfile {sc.get('seccompProfile')}"


def test_every_pod_runs_hardened():
    """Every container of every pod: non-root (a numeric uid), no privilege escalation,
    all capabilities dropped, the RuntimeDefault seccomp profile; claims writable via fsGroup."""
    pods = _pod_specs()
    names = [n for n, _ in pods]
    assert len(pods) >= 5, names   # data loader, MLflow, Ray head, GPU workers, RayJob submitter
    for name, pod in pods:
        assert pod is not None, f"{name}: no pod template, so the operator builds one with no securityContext"
        pod_sc = pod.get("securityContext") or {}
        assert pod_sc.get("runAsNonRoot") is True, f"{name}: pod securityContext.runAsNonRoot"
        for c in pod.get("initContainers", []) + pod["containers"]:
            _check_container_security(f"{name}/{c['name']}", c.get("securityContext") or {}, pod_sc)
            gid = (c.get("securityContext") or {}).get("runAsGroup", pod_sc.get("runAsGroup"))
            if any("persistentVolumeClaim" in v for v in pod.get("volumes", [])):
                assert pod_sc.get("fsGroup") == gid, \
                    f"{name}: fsGroup {pod_sc.get('fsGroup')} must be the container's group {gid}, or the claim is not writable"
    # the autoscaler sidecar, when someone turns it on
    for path in sorted(KUBERAY.glob("*.yaml")):
        for d in _docs(path):
            spec = {"RayCluster": d.get("spec"), "RayService": d.get("spec", {}).get("rayClusterConfig")}.get(d.get("kind"))
            if spec:
                auto = (spec.get("autoscalerOptions") or {}).get("securityContext")
                head_pod_sc = spec["headGroupSpec"]["template"]["spec"]["securityContext"]
                _check_container_security(f"{path.name} autoscalerOptions", auto or {}, head_pod_sc)


def test_pods_of_the_project_image_run_as_its_user():
    """The Dockerfile's numeric USER is the uid/gid every pod of that image runs as."""
    docker = (CLUSTER / "docker" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", docker, re.M)
    assert users, "cluster/docker/Dockerfile must end with a numeric USER uid:gid"
    uid, gid = map(int, users[-1])
    assert uid == 1000 and gid == 100, "rayproject/ray's `ray` user is uid 1000, gid 100 (`users`)"
    _, cluster = _kind("RayCluster")
    image = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    checked = []
    for name, pod in _pod_specs():
        pod_sc = pod.get("securityContext") or {}
        for c in pod["containers"]:
            if c["image"] == image or c["image"].startswith("rayproject/ray"):
                sc = c.get("securityContext") or {}
                got = (sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup")))
                assert got == (uid, gid), f"{name}/{c['name']} runs {c['image']} as {got}, the image's user is {(uid, gid)}"
                checked.append(name)
    assert len(checked) >= 4, checked   # head, workers, submitter, data loader


def test_rayjob_submitter_uses_the_head_image():
    """The submitter uploads runtimeEnvYAML's working_dir from its own filesystem: the head's image."""
    _, job = _kind("RayJob")
    _, cluster = _kind("RayCluster")
    submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    assert submitter["image"] == cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    assert not submitter.get("command"), "leave the command empty: the operator fills in `ray job submit`"


def _selects(selector: dict | None, labels: dict) -> bool:
    assert set(selector or {}) <= {"matchLabels"}, f"the test models matchLabels only: {selector}"
    return all(labels.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())


@functools.lru_cache(maxsize=None)
def _policies() -> tuple[dict, ...]:   # parsed once: _allowed asks for them for every pair of pods (read-only)
    return tuple(d for p in sorted(KUBERAY.glob("*.yaml")) for d in _docs(p) if d.get("kind") == "NetworkPolicy")


def _allowed(dst: dict, src: dict, src_ns: dict = NAMESPACE_LABELS) -> set[tuple[int, int]]:
    """TCP port ranges a pod labelled `src` (in namespace `src_ns`) may open on a pod labelled `dst`."""
    out = set()
    for pol in _policies():
        if not _selects(pol["spec"]["podSelector"], dst) or "Ingress" not in pol["spec"].get("policyTypes", []):
            continue
        for rule in pol["spec"].get("ingress", []):
            for peer in rule["from"]:
                assert "ipBlock" not in peer, f"{pol['metadata']['name']}: no ipBlock peers"
                ns_ok = _selects(peer["namespaceSelector"], src_ns) if "namespaceSelector" in peer else src_ns == NAMESPACE_LABELS
                if ns_ok and ("podSelector" not in peer or _selects(peer["podSelector"], src)):
                    out |= {(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]}
    return out


def _pod_labels() -> dict[str, dict]:
    """The labels KubeRay and the manifests put on each kind of pod."""
    _, cluster = _kind("RayCluster")
    _, job = _kind("RayJob")
    name = cluster["metadata"]["name"]
    spec = cluster["spec"]
    labels = {"head": {**spec["headGroupSpec"]["template"]["metadata"].get("labels", {}),
                       "ray.io/cluster": name, "ray.io/node-type": "head", "ray.io/group": "headgroup"}}
    for g in spec["workerGroupSpecs"]:
        labels[g["groupName"]] = {**g["template"]["metadata"].get("labels", {}), "ray.io/cluster": name,
                                  "ray.io/node-type": "worker", "ray.io/group": g["groupName"]}
    labels["submitter"] = job["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    mlflow = next(d for p in KUBERAY.glob("*.yaml") for d in _docs(p)
                  if d.get("kind") == "Deployment" and d["metadata"]["name"] == "mlflow")
    labels["mlflow"] = mlflow["spec"]["template"]["metadata"]["labels"]
    labels["other pod"] = {"app": "notebook"}
    return labels


def test_networkpolicy_covers_head_and_workers_with_ray_ports_only():
    """Ray pods accept from each other exactly the ports pinned in rayStartParams, the
    worker-port range and the ephemeral range (torch.distributed/NCCL); nothing else, from
    nobody else, except the job server for the submitter and the operator."""
    for pol in _policies():
        for rule in pol["spec"].get("ingress", []):
            assert rule.get("from") and rule.get("ports"), \
                f"{pol['metadata']['name']}: a rule without `from` or `ports` opens every source or port"
            assert all(p.get("protocol") == "TCP" for p in rule["ports"]), pol["metadata"]["name"]
    _, cluster = _kind("RayCluster")
    head_params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    missing = [k for k in HEAD_PORT_PARAMS + NODE_PORT_PARAMS if k not in head_params]
    assert not missing, f"head rayStartParams must pin {missing} (else Ray picks random ports)"
    for g in cluster["spec"]["workerGroupSpecs"]:
        differ = {k: g["rayStartParams"].get(k) for k in NODE_PORT_PARAMS if g["rayStartParams"].get(k) != head_params[k]}
        assert not differ, f"{g['groupName']}: pinned ports must equal the head's (one list in the policy): {differ}"

    ports = {int(head_params[k]) for k in HEAD_PORT_PARAMS + NODE_PORT_PARAMS if "worker-port" not in k}
    expected = {(p, p) for p in ports}
    expected |= {(int(head_params["min-worker-port"]), int(head_params["max-worker-port"])), EPHEMERAL}

    labels = _pod_labels()
    ray_pods = ["head"] + [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]]
    for dst in ray_pods:
        for src in ray_pods:
            assert _allowed(labels[dst], labels[src]) == expected, (dst, src, sorted(_allowed(labels[dst], labels[src])))
        assert not _allowed(labels[dst], labels["other pod"]), f"{dst}: open to any pod of the namespace"
        assert not _allowed(labels[dst], labels["mlflow"]), f"{dst}: open to MLflow"
    job_server = {(int(head_params["dashboard-port"]),) * 2}
    assert _allowed(labels["head"], labels["submitter"]) == job_server
    operator_ns = {"kubernetes.io/metadata.name": "kuberay-operator"}
    assert _allowed(labels["head"], {}, operator_ns) == job_server, "the operator must reach the job server"
    for g in ray_pods[1:]:
        assert not _allowed(labels[g], labels["submitter"]) and not _allowed(labels[g], {}, operator_ns)
    everything = set().union(*(_allowed(labels[d], labels[s]) for d in labels for s in labels))
    for unused in (10001, 8000):   # Ray Client, Serve: not used by this project
        assert not any(lo <= unused <= hi for lo, hi in everything), f"port {unused} is open"


def test_networkpolicy_lets_only_ray_pods_reach_mlflow():
    labels = _pod_labels()
    _, cluster = _kind("RayCluster")
    for src in ["head"] + [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]]:
        assert _allowed(labels["mlflow"], labels[src]) == {(5000, 5000)}, src
    for src in ("submitter", "other pod"):
        assert not _allowed(labels["mlflow"], labels[src]), src


def test_token_auth_is_documented_and_its_snippet_is_valid():
    """authOptions stays off (operators < 1.5.1 reject it); the commented lines, uncommented,
    give a RayCluster with token auth, and the README says how to use the token."""
    path, cluster = _kind("RayCluster")
    assert "authOptions" not in cluster["spec"]
    lines = path.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip() == "# authOptions:")
    on = lines[:i] + [line.replace("# ", "", 1) for line in lines[i:i + 2]] + lines[i + 2:]
    with_auth = next(d for d in yaml.safe_load_all("\n".join(on)) if d and d.get("kind") == "RayCluster")
    assert with_auth["spec"]["authOptions"] == {"mode": "token"}
    assert {k: v for k, v in with_auth["spec"].items() if k != "authOptions"} == cluster["spec"]
    readme = (CLUSTER / "README.md").read_text()
    for needle in ("authOptions", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "auth_token", "get secret minimind"):
        assert needle in readme, f"cluster/README.md does not say {needle!r}"
