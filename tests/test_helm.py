"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk, no
helm binary), every manifest validated against the Kubernetes schemas."""
from __future__ import annotations

import copy
import json
import pathlib

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "helm" / "specdec"
KUBE_VERSION = "1.33.0"
CRDS = {"ServiceMonitor"}  # from the Prometheus Operator: no schema in kubernetes-validate

VARIATIONS = {
    "defaults": {},
    "gpu, pvc cache, otel, tls + auth, hpa, service monitor": {
        "image": {"variant": "cuda"},
        "verifier": {"device": "cuda", "gpus": 1, "dtype": "bf16"},
        "drafter": {"device": "cuda", "gpus": 1},
        "models": {"cache": {"type": "pvc", "size": "40Gi", "storageClassName": "fast"}},
        "otel": {"enabled": True, "endpoint": "http://otel-collector.observability:4317"},
        "tls": {"enabled": True, "secretName": "specdec-tls", "clientCA": True},
        "auth": {"enabled": True, "secretName": "specdec-auth"},
        "autoscaling": {"enabled": True, "maxReplicas": 6},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "headless, existing claim, no pull, fixed gamma": {
        "replicaCount": 3, "service": {"headless": True},
        "models": {"pull": False, "cache": {"type": "existingClaim", "existingClaim": "shared-models"}},
        "coordinator": {"gamma": 4}, "podDisruptionBudget": {"enabled": False},
    },
    "split mode": {
        "mode": "split", "backendTls": {"secretName": "specdec-backend-mtls"},
        "verifier": {"device": "cuda", "gpus": 1}, "drafter": {"device": "cuda", "gpus": 1},
    },
}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema(values)
    rendered = chart.render(values, name="rel", namespace="ml", is_install=True)
    docs = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def arg(container: dict, flag: str) -> str | None:
    return next((a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "=")), None)


@pytest.mark.parametrize("name", list(VARIATIONS))
def test_chart_lints_renders_and_validates(name):
    values = VARIATIONS[name]
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", list(VARIATIONS))
def test_pods_run_the_services_with_grpc_probes_resources_and_security(name):
    values = VARIATIONS[name]
    split = values.get("mode") == "split"
    deployments = {d["metadata"]["name"]: d for d in by_kind(render(values), "Deployment")}
    if split:
        assert set(deployments) == {"rel-specdec-coordinator", "rel-specdec-verifier", "rel-specdec-drafter"}
    else:
        (deployment,) = deployments.values()
        assert set(containers(deployment)) == {"coordinator", "verifier", "drafter"}
        # Sidecars: the model services on Unix sockets in a pod-private emptyDir, no TCP port;
        # the coordinator pointed there.
        c = containers(deployment)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert "emptyDir" in volumes["sockets"]
        for name in ("verifier", "drafter"):
            assert arg(c[name], "--uds") == f"/run/specdec/private/{name}.sock"
            assert arg(c[name], "--host") is None and arg(c[name], "--port") is None
            assert arg(c["coordinator"], f"--{name}") == f"unix:/run/specdec/private/{name}.sock"
        for name in c:
            assert {"name": "sockets", "mountPath": "/run/specdec"} in c[name]["volumeMounts"], name
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        for container in pod["containers"]:
            health_port = int(arg(container, "--health-port"))
            assert arg(container, "--health-host") == "0.0.0.0"  # kubelet probes reach the pod's IP
            declared = {p["containerPort"] for p in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == health_port, (container["name"], probe)
            assert health_port in declared
        # The startup probe allows for pulling and loading the models.
        startup = pod["containers"][0]["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_the_service_exposes_only_the_coordinator():
    for name, values in VARIATIONS.items():
        docs = render(values)
        public = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "rel-specdec")
        # gRPC, and the OpenAI-compatible HTTP API, each to the coordinator container's port of that name.
        assert [(p["port"], p["targetPort"]) for p in public["spec"]["ports"]] == [(50051, "grpc"), (8000, "http")]
        coordinator = next(c for d in by_kind(docs, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]
                           if c["name"] == "coordinator")
        named = {p["name"]: p["containerPort"] for p in coordinator["ports"]}
        assert named["http"] == 8000 and "--http-port=8000" in coordinator["args"], name
        model_ports = {50052, 50053, 50062, 50063}
        assert not model_ports & {p["port"] for p in public["spec"]["ports"]}
        if values.get("service", {}).get("headless"):
            assert public["spec"]["clusterIP"] == "None"


def test_gpu_requests_otel_tls_and_auth_are_wired():
    docs = render(VARIATIONS["gpu, pvc cache, otel, tls + auth, hpa, service monitor"])
    (deployment,) = by_kind(docs, "Deployment")
    c = containers(deployment)
    assert c["verifier"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert arg(c["verifier"], "--device") == "cuda"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.0-cuda")
    env = {e["name"]: e.get("value") for e in c["coordinator"]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert env["OTEL_SERVICE_NAME"] == "specdec-coordinator"
    assert {e["name"]: e.get("value") for e in c["verifier"]["env"]}["OTEL_SERVICE_NAME"] == "specdec-verifier"
    assert arg(c["coordinator"], "--tls-client-ca") == "/etc/specdec/tls/ca.crt"
    assert arg(c["coordinator"], "--auth-token-file") == "/etc/specdec/auth/token"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "specdec-tls"
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "rel-specdec-models"
    assert by_kind(docs, "PersistentVolumeClaim")[0]["spec"]["storageClassName"] == "fast"
    assert by_kind(docs, "HorizontalPodAutoscaler")[0]["spec"]["maxReplicas"] == 6
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    assert by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["port"] == "metrics"
    init = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["specdec", "models", "pull"]
    assert init["args"] == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


def test_split_mode_uses_mutual_tls_between_the_deployments():
    docs = render(VARIATIONS["split mode"])
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    coordinator = containers(deployments["rel-specdec-coordinator"])["coordinator"]
    assert arg(coordinator, "--verifier") == "rel-specdec-verifier:50052"
    assert arg(coordinator, "--backend-tls-cert") == "/etc/specdec/backend-tls/tls.crt"
    for name in ("verifier", "drafter"):
        container = containers(deployments[f"rel-specdec-{name}"])[name]
        assert arg(container, "--host") == "0.0.0.0" and arg(container, "--tls-client-ca")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        init = deployments[f"rel-specdec-{name}"]["spec"]["template"]["spec"]["initContainers"][0]
        assert len(init["args"]) == 1  # each pod pulls only its own model
    internal = {s["metadata"]["name"] for s in by_kind(docs, "Service")}
    assert internal == {"rel-specdec", "rel-specdec-verifier", "rel-specdec-drafter"}


@pytest.mark.parametrize("bad, message", [
    ({"mode": "split"}, "secretName"),                       # split without mTLS
    ({"tls": {"enabled": True}}, "secretName"),              # TLS without a secret
    ({"coordinator": {"gamma": "fast"}}, "gamma"),
    ({"verifier": {"device": "tpu"}}, "device"),
    ({"models": {"cache": {"type": "existingClaim"}}}, "existingClaim"),
    ({"replicas": 2}, "replicas"),                           # a typo'd key
    # The benchmark-only settings never reach a served model, whatever the operator passes on.
    ({"verifier": {"extraArgs": ["--synthetic-acceptance", "0.8"]}}, "extraArgs"),
    ({"verifier": {"extraArgs": ["--synthetic-acceptance=0.8"]}}, "extraArgs"),
    ({"drafter": {"extraArgs": ["--random-weights", "1"]}}, "extraArgs"),
])
def test_schema_refuses_bad_values_with_the_key_named(bad, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError) as error:
        chart.validate_schema(copy.deepcopy(bad))
    assert message in str(error.value)


def test_the_image_and_the_chart_agree():
    """The chart runs the image's entrypoints, as the image's non-root user."""
    dockerfile = (CHART.parent.parent / "docker" / "Dockerfile").read_text()
    pyproject = (CHART.parent.parent.parent / "pyproject.toml").read_text()
    user = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER "))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert user == f"{values['podSecurityContext']['runAsUser']}:{values['podSecurityContext']['runAsGroup']}"
    assert "ARG VARIANT=cpu" in dockerfile and "FROM base-${VARIANT}" in dockerfile
    (deployment,) = by_kind(render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    for container in pod["containers"] + pod["initContainers"]:
        entrypoint = container["command"][0]
        assert f'{entrypoint} = "' in pyproject, entrypoint


def test_the_chart_serves_the_default_pair_as_specdec_up_does(monkeypatch):
    import importlib.util

    from specdec.weights.pairs import DEFAULT_PAIR, PAIRS
    from specdec_tools.launcher import StackOptions
    pair = PAIRS[DEFAULT_PAIR]
    # The image has no llama-cpp-python: the draft `specdec up` serves there.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    draft_quantize = StackOptions.for_pair(pair).draft_quantize
    (deployment,) = by_kind(render({}), "Deployment")
    args = {c["name"]: c["args"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert f"--quantize={pair.target_quantize}" in args["verifier"] and f"--dtype={pair.target_dtype}" in args["verifier"]
    assert f"--quantize={draft_quantize}" in args["drafter"] and f"--dtype={pair.draft_dtype}" in args["drafter"]
    assert f"--head-vocab={pair.draft_head_vocab}" in args["drafter"]
    (deployment,) = by_kind(render({"verifier": {"quantize": "none"}}), "Deployment")
    args = {c["name"]: c["args"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert "--quantize=none" in args["verifier"]


def test_the_coordinator_drafts_with_the_hybrid_proposer_unless_told_otherwise():
    (deployment,) = by_kind(render({}), "Deployment")
    args = {c["name"]: c["args"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    # Other requests' outputs are searched only when asked for: a lookup's timing tells what they held.
    assert "--proposer=hybrid" in args["coordinator"] and "--lookup-history-tokens=0" in args["coordinator"]
    (deployment,) = by_kind(render({"coordinator": {"proposer": "model", "lookupHistoryTokens": 4096}}),
                            "Deployment")
    args = {c["name"]: c["args"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert "--proposer=model" in args["coordinator"] and "--lookup-history-tokens=4096" in args["coordinator"]


def test_the_schemas_choices_are_the_registries():
    """What the chart lets an operator pick is what the services take: a proposer kind,
    quantization or dtype registered (or dropped) in the code shows up here, or fails."""
    import json
    from coordinator.proposers import KINDS
    from specdec.runtime.options import DTYPES
    from specdec.runtime.quant import QUANTIZE
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert set(schema["coordinator"]["properties"]["proposer"]["enum"]) == set(KINDS)
    for service in ("drafter", "verifier"):
        properties = schema[service]["properties"]
        assert set(properties["quantize"]["enum"]) == set(QUANTIZE), service
        assert set(properties["dtype"]["enum"]) == set(DTYPES), service


def test_the_charts_settings_are_derived_from_the_settings_tables(monkeypatch):
    """A setting with a `values` key becomes its container argument and its schema
    entry by generation (specdec_tools/chart_settings.py): the committed parts are
    current, and a new setting needs no hand edit of the template or the schema."""
    from specdec.rpc.flags import Setting
    from specdec_tools import chart_settings
    assert chart_settings.main(["--check"]) == 0
    new = Setting("--draft-warmth", dict(type=int, default=3, help="a new setting, 100%% made up"), values="draftWarmth")
    blocks = list(chart_settings.BLOCKS)
    blocks[1] = (blocks[1][0], (*blocks[1][1], new), blocks[1][2])
    monkeypatch.setattr(chart_settings, "BLOCKS", tuple(blocks))
    assert '"--draft-warmth=%v" (.draftWarmth | int)' in chart_settings.template()
    schema = chart_settings.schema(json.loads(chart_settings.SCHEMA.read_text()))
    assert schema["properties"]["coordinator"]["properties"]["draftWarmth"] == {
        "type": "integer", "description": "a new setting, 100% made up"}
    # What was tuned by hand stays: the proposer's enum is the kinds', gamma keeps its anyOf.
    coordinator = schema["properties"]["coordinator"]["properties"]
    assert "anyOf" in coordinator["gamma"] and "type" not in coordinator["gamma"]
    assert coordinator["lookupHistoryTokens"]["minimum"] == 0
    with monkeypatch.context() as m:   # a stale committed part is caught
        m.setattr(chart_settings, "BLOCKS", tuple(blocks))
        assert chart_settings.main(["--check"]) == 1
