"""cluster/kuberay/rayservice.yaml is consistent with the code and as locked down as the other recipes.

Fast and without a cluster: the embedded Serve config passes Ray Serve's own schema, its
import path and args build the app (the same builder `minimind-ray serve` uses), the pods are
hardened like raycluster.yaml's, the shared claim is mounted read-only, nothing is exposed
beyond ClusterIP, and port 8000 is open only to labelled clients.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "cluster" / "kuberay" / "rayservice.yaml"


def _docs() -> list:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d is not None]


def _one(kind: str) -> dict:
    found = [d for d in _docs() if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in {MANIFEST.name}"
    return found[0]


def _serve_config() -> dict:
    return yaml.safe_load(_one("RayService")["spec"]["serveConfigV2"])


def _pods() -> list:
    spec = _one("RayService")["spec"]["rayClusterConfig"]
    return [("head", spec["headGroupSpec"]["template"])] + \
        [(g["groupName"], g["template"]) for g in spec["workerGroupSpecs"]]


def test_serve_config_passes_rays_schema():
    from ray.serve.schema import ServeDeploySchema

    cfg = ServeDeploySchema.model_validate(_serve_config())
    assert [a.name for a in cfg.applications] == ["minimind"]
    assert cfg.http_options.port == 8000


def test_the_app_import_path_and_args_build_the_serve_app():
    """The same builder the CLI uses accepts the args (unknown or invalid ones would raise)."""
    from ray.serve import Application

    app = _serve_config()["applications"][0]
    module, _, attr = app["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert isinstance(builder(app["args"]), Application)
    from minimind_ray.serve.options import options_from_dict

    opts = options_from_dict(app["args"])
    assert opts.weights.startswith(("models:/", "runs:/", "/mnt/shared/"))
    assert opts.tracking_uri == "http://mlflow:5000"
    low, high = opts.autoscale_range()
    workers = _one("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    cpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert high * opts.cpus_per_replica <= workers["maxReplicas"] * cpus, \
        "autoscale's MAX replicas must fit on maxReplicas worker pods"
    assert "pip" not in app.get("runtime_env", {}), "dependencies belong in the image"


def test_serving_pods_are_hardened_and_read_the_shared_claim_only():
    for name, template in _pods():
        pod = template["spec"]
        pod_sc = pod["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 1000 and pod_sc["fsGroup"] == 100, name
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["runAsNonRoot"] is True, name
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("MLFLOW_TRACKING_URI") == "http://mlflow:5000", name
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert mounts["/mnt/shared"].get("readOnly") is True, f"{name}: serving never writes the claim"
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert [v["persistentVolumeClaim"]["claimName"] for v in claims] == ["minimind-shared"], name
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "minimind-serve", name
    auto = _one("RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert auto["allowPrivilegeEscalation"] is False and auto["capabilities"] == {"drop": ["ALL"]}


def test_nothing_is_exposed_beyond_the_cluster_and_8000_only_to_clients():
    spec = _one("RayService")["spec"]
    assert spec["rayClusterConfig"]["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    assert (spec.get("serveService") or {}).get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    assert not [d for d in _docs() if d.get("kind") in ("Ingress", "Service")]
    text = MANIFEST.read_text()
    assert "port-forward" in text and "authenticat" in text, "say how to reach it and what guards it"
    pol = _one("NetworkPolicy")["spec"]
    assert pol["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "minimind-serve"}
    open_8000 = [r["from"] for r in pol["ingress"] if any(p["port"] == 8000 for p in r["ports"])]
    for peers in open_8000:
        for peer in peers:
            assert "ipBlock" not in peer and "namespaceSelector" not in peer, peer
            labels = peer["podSelector"]["matchLabels"]
            assert labels in ({"app.kubernetes.io/name": "minimind-serve"}, {"minimind-ray/serve-client": "true"})
    for rule in pol["ingress"]:
        assert rule.get("from") and rule.get("ports") and all(p["protocol"] == "TCP" for p in rule["ports"])


def test_a_public_bind_address_carries_its_reason():
    """Binding all interfaces is only right inside a pod; the config says who can reach it."""
    cfg_text = _one("RayService")["spec"]["serveConfigV2"]
    assert _serve_config()["http_options"]["host"] == "0.0.0.0"
    above = cfg_text.split("http_options:")[0]
    assert "ClusterIP" in above and "port-forward" in above


def test_metrics_are_scraped_from_every_pod_and_the_api_key_comes_from_a_secret():
    """The PodMonitor scrapes the `metrics` port each Ray pod names (Ray's metrics export port, pinned in
    rayStartParams), the NetworkPolicy opens that port to the monitoring namespace only, and every pod reads the
    API key from a Secret: never a literal in the manifest, nor in the Serve config's args."""
    spec = _one("RayService")["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for g in groups:
        port = int(g["rayStartParams"]["metrics-export-port"])
        for c in g["template"]["spec"]["containers"]:
            assert {"containerPort": port, "name": "metrics"} in c["ports"]
            key = [e for e in c["env"] if e["name"] == "MINIMIND_RAY_API_KEY"]
            assert len(key) == 1 and "value" not in key[0] and key[0]["valueFrom"]["secretKeyRef"]["name"]
    monitor = _one("PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"] == {"app.kubernetes.io/name": "minimind-serve"}
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"]
    args = _serve_config()["applications"][0]["args"]
    assert not any("key" in k for k in args)
    rules = [r for r in _one("NetworkPolicy")["spec"]["ingress"] if any(p["port"] == 8080 for p in r["ports"])]
    outside = [r for r in rules if any("namespaceSelector" in peer for peer in r["from"])]
    assert len(outside) == 1 and [p["port"] for p in outside[0]["ports"]] == [8080]
