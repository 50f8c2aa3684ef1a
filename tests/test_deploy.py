"""The deployment files: the Kubernetes manifests against the Kubernetes schemas
(kubernetes-validate, offline, strict: no field the schema does not know), and what the
node server needs of them and of the Dockerfile (non-root, a health check, host IPC
and the host's shared memory for the engines, the ports the server listens on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "k8s" / "tensordb.yaml"


def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]


def test_every_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (the test extra)")
    version = kv.latest_version()
    kinds = []
    for doc in docs():
        kv.validate(doc, version, strict=True)  # raises ValidationError naming the field
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Namespace", "Service", "Service",
                             "StatefulSet"]


def test_a_broken_manifest_is_caught() -> None:
    """The validation can fail: a misspelt field and a wrong type are found."""
    kv = pytest.importorskip("kubernetes_validate",
                             reason="kubernetes-validate is not installed (the test extra)")
    (ds,) = [d for d in docs() if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["hostIPc"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)
    (ds,) = [d for d in docs() if d["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, kv.latest_version(), strict=True)


def test_the_daemonset_shares_the_hosts_memory_and_runs_unprivileged() -> None:
    (ds,) = [d for d in docs() if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True and pod["securityContext"]["runAsNonRoot"] is True
    vols = {v["name"]: v for v in pod["volumes"]}
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert vols[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"
    assert "tensordb ping" in " ".join(c["livenessProbe"]["exec"]["command"])
    cm = next(d for d in docs() if d["kind"] == "ConfigMap")["data"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"flight": int(cm["TENSORDB_PORT"]), "data": int(cm["TENSORDB_DATA_PORT"]),
                     "metrics": int(cm["TENSORDB_METRICS_PORT"])}
    svc = next(d for d in docs() if d["kind"] == "Service" and d["metadata"]["name"] == "tensordb")
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)


def test_the_image_runs_as_a_user_with_a_health_check() -> None:
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(str(ROOT / "Dockerfile"))
    final = [i for i in parser.structure
             if i["startline"] > max(j["startline"] for j in parser.structure
                                     if j["instruction"] == "FROM")]
    by = {i["instruction"]: i["value"] for i in final}
    assert by["USER"].split(":")[0] not in ("0", "root")
    assert "tensordb ping" in by["HEALTHCHECK"]
    exposed = set(re.findall(r"\d+", by["EXPOSE"]))
    env = parser.envs
    assert {env["TENSORDB_PORT"], env["TENSORDB_DATA_PORT"], env["TENSORDB_METRICS_PORT"]} \
        == exposed
    assert "tensordb" in by["ENTRYPOINT"] and "serve" in by["ENTRYPOINT"]


def test_ping_of_an_address_nobody_serves_fails() -> None:
    """The health check's command: a node that does not answer is a non-zero exit."""
    from typer.testing import CliRunner

    from tensordb import cli

    r = CliRunner().invoke(cli.app, ["ping", "127.0.0.1:1", "--timeout", "1"],
                           env={"TENSORDB_TOKEN": "", "TENSORDB_TOKEN_FILE": ""})
    assert r.exit_code != 0
    assert "127.0.0.1:1" in r.output
