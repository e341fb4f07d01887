"""deploy/k8s: rendered with kustomize, validated against the Kubernetes schemas offline,
consistent with the server's settings and with the files they are generated from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "multinode-ray"]
LEARNING = {"learning": K8S / "learning", "learning-gpu": K8S / "learning" / "gpu"}  # the servers + the learn job
K8S_VERSION = "1.32.0"
CRD_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PrometheusRule"}  # no schema offline: checked below


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found: tests/run.sh installs it (apt kubernetes-client) or the image has it")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return ({name: render(K8S / "overlays" / name) for name in OVERLAYS} | {"monitoring": render(K8S / "monitoring")}
            | {name: render(path) for name, path in LEARNING.items()})


def test_generated_files_are_current():
    result = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_prometheus_rule_is_alerts_yml(rendered):
    (rule,) = [d for d in rendered["monitoring"] if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())["groups"]


@pytest.mark.parametrize("name", [*OVERLAYS, "monitoring", *LEARNING])
def test_manifests_validate_against_kubernetes_schemas(rendered, name):
    import kubernetes_validate

    for doc in rendered[name]:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"].split("/")[0] in ("leaderworkerset.x-k8s.io", "monitoring.coreos.com")
            assert doc["metadata"]["name"] and doc["spec"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _server_pod(docs: list[dict]) -> dict:
    for doc in docs:
        if doc["kind"] == "Deployment":
            return doc["spec"]["template"]
        if doc["kind"] == "LeaderWorkerSet":
            return doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    raise AssertionError("no server pod")


@pytest.mark.parametrize("name", [*OVERLAYS, *LEARNING])
def test_probes_ports_and_grace_match_the_server(rendered, name, tmp_path):
    from dynamo_spec.config.loader import load_settings

    docs = rendered[name]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    container = _server_pod(docs)["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    settings = load_settings(path, [], {k: v for k, v in env.items() if k.startswith("DYNAMO_SPEC_")}).settings
    assert settings.server.host == "0.0.0.0"  # reachable from the kubelet and the Service
    (port,) = container["ports"]
    assert port["containerPort"] == settings.server.port
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in (port["name"], port["containerPort"])
    pod = _server_pod(docs)["spec"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert pod["terminationGracePeriodSeconds"] >= (int(pre_stop[-1]) + settings.server.shutdown_grace_seconds
                                                    + settings.server.engine_stop_seconds)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["config"] == "/etc/dynamo-spec"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert ("--config /etc/dynamo-spec/config.yaml" in " ".join(container.get("args", []))
            or env.get("DYNAMO_SPEC_CONFIG") == "/etc/dynamo-spec/config.yaml")  # launch/ray_leader.sh
    (service,) = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"]
    labels = _server_pod(docs)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def test_gpu_overlays_ask_for_gpus_and_the_token(rendered):
    for name in ("gpu", "multinode-ray"):
        container = _server_pod(rendered[name])["spec"]["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert any(e["name"] == "HF_TOKEN" and e["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
                   for e in container["env"])
    cpu = _server_pod(rendered["cpu"])["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(cpu.get("resources"))


def test_multinode_overlay_uses_ray_and_its_config_map(rendered):
    docs = rendered["multinode-ray"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["engine"]["distributed_executor_backend"] == "ray"
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    gpus = int(template["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus * template["size"] == config["engine"]["tensor_parallel_size"] * config["engine"]["pipeline_parallel_size"]
    volumes = {v["name"]: v for v in template["leaderTemplate"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]  # the hashed name
    assert not [d for d in docs if d["kind"] == "Deployment"]


def _commands(script: str) -> list[list[str]]:
    """The dynamo-spec command lines of a job's shell script (continuations joined)."""
    import shlex

    lines = script.replace("\\\n", " ").splitlines()
    return [shlex.split(line)[1:] for line in lines if line.strip().startswith("dynamo-spec ")]


@pytest.mark.parametrize("name", LEARNING)
def test_the_learn_job_shares_the_servers_volume_config_and_key_and_swaps_every_replica(rendered, name, tmp_path):
    from dynamo_spec.cli import build_parser
    from dynamo_spec.config.loader import load_settings

    docs = rendered[name]
    server = _server_pod(docs)["spec"]
    (cronjob,) = [d for d in docs if d["kind"] == "CronJob"]
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    job = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (learn,) = job["containers"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])

    def settings_of(container):
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        return load_settings(path, [], {k: v for k, v in env.items() if k.startswith("DYNAMO_SPEC_")}).settings

    served, learnt = settings_of(server["containers"][0]), settings_of(learn)
    assert served.learning.capture is True and learnt.learning.dir == served.learning.dir
    # the same claim (ReadWriteMany), mounted where both read learning.dir; the same config; the same key
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in (server, job):
        container = pod["containers"][0]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert claims[mounts[served.learning.dir]] == pvc["metadata"]["name"]
        configs = {v["name"]: v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
        assert configs[mounts["/etc/dynamo-spec"]] == config_map["metadata"]["name"]  # the hashed name
        keys = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "DYNAMO_SPEC_SERVER__API_KEY"]
        assert keys == [{"name": "dynamo-spec-api-key", "key": "key", "optional": True}]
    # learn-draft, then swap-draft to each replica through the headless Service of the server pods
    commands = _commands(learn["args"][0])
    assert [c[0] for c in commands] == ["learn-draft", "swap-draft"]
    parser = build_parser()
    for command in commands:
        args, extra = parser.parse_known_args(command)
        assert args.config == "/etc/dynamo-spec/config.yaml"
        assert all(e.startswith("--engine.") or e.startswith("--speculative.") or not e.startswith("--")
                   for e in extra), extra
    args, _ = parser.parse_known_args(commands[1])
    (service_url,) = args.service
    host, port = service_url.removeprefix("http://").split(":")
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host]
    assert headless["spec"].get("clusterIP") == "None" and int(port) == served.server.port
    labels = _server_pod(docs)["metadata"]["labels"]
    assert headless["spec"]["selector"] and all(labels.get(k) == v for k, v in headless["spec"]["selector"].items())
    if name == "learning-gpu":  # an 8B target: the cycle on a GPU of its own; the replicas on the V1 runner (the swap)
        assert int(learn["resources"]["limits"]["nvidia.com/gpu"]) == 1
        env = {e["name"]: e.get("value") for e in server["containers"][0]["env"]}
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    else:
        assert "nvidia.com/gpu" not in str(learn.get("resources"))
