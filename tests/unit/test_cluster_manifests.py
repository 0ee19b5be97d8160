"""The Kubernetes manifests under deploy/kubernetes/ are valid Kubernetes objects.

Checked against the Kubernetes JSON schemas bundled by ``kubernetes-validate``
(strict: an unknown or misspelt field fails). No API server is available here:
applying them to a live cluster is not tested (deploy/kubernetes/README.md says so).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentbox.config import Settings
from agentbox.gateway import load_registry

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.37.0"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((f"{path.name}:{doc['kind']}", doc))
    return out


DOCS = _docs()


def test_there_are_manifests() -> None:
    kinds = {doc["kind"] for _, doc in DOCS}
    assert {"Namespace", "ConfigMap", "Secret", "DaemonSet", "RuntimeClass", "Deployment"} <= kinds


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[n for n, _ in DOCS])
def test_each_manifest_matches_its_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev) missing")
    kv.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_can_fail() -> None:
    """Positive control: a misspelt field in a node pod is caught."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev) missing")
    ds = next(doc for name, doc in DOCS if name.endswith(":DaemonSet"))
    bad = yaml.safe_load(yaml.safe_dump(ds))
    bad["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {"privileged": True}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_the_model_key_reaches_node_pods_only_and_the_registry_loads(tmp_path: Path) -> None:
    pods = [d for _, d in DOCS if d["kind"] in ("DaemonSet", "Deployment")]
    for d in pods:
        spec = d["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False
        (c,) = spec["containers"]
        assert "agentbox node start" in " ".join(c["args"])
        assert {"secretRef": {"name": "agentbox-model-keys"}} in c["envFrom"]
    # The ConfigMap's registry is one agentbox accepts (its key named, never inline).
    cm = next(d for _, d in DOCS if d["kind"] == "ConfigMap")
    text = cm["data"]["models.toml"]
    assert "key_env" in text and "sk-" not in text
    tomllib.loads(text)
    (tmp_path / "models.toml").write_text(text)
    reg = load_registry(Settings(data_dir=tmp_path, models_file=tmp_path / "models.toml"))
    assert reg.default == "claude-sonnet"


def test_node_pods_hold_the_cluster_secrets_root_only() -> None:
    """Issue 33 §1: every node pod gets the cluster's Ray token and cluster key (Ray's token
    authentication, the node proof) from a Secret mounted 0400, where
    AGENTBOX_CLUSTER_SECRETS points; the launcher runs beside the node (its socket)."""
    pods = [d for _, d in DOCS if d["kind"] in ("DaemonSet", "Deployment")]
    assert pods
    for d in pods:
        spec = d["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        vol = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName")
                   == "agentbox-cluster-secrets")  # fmt: skip
        assert vol["secret"]["defaultMode"] == 0o400
        mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["AGENTBOX_CLUSTER_SECRETS"] == mount["mountPath"] and mount["readOnly"]
        assert "agentbox launcher serve" in " ".join(c["args"])
