"""deploy/kubernetes/duoka-train.yaml and duoka-serve.yaml: every object valid against
Kubernetes' own schemas (kubernetes-validate carries them: no cluster, no network), strictly
(an unknown or misspelt field fails), from the first version where all they use is GA (1.31:
podFailurePolicy) to the newest the package knows. Training: its parts agree with each other,
its config loads in duoka, and a pod's environment gives duoka the node rank, count and
rendezvous the manifest means. Serving: the probes reach /health on the port duoka listens
on, the pod's grace outlasts duoka's whole stop, the key comes from the Secret."""

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from duoka.cli import SERVE_API_KEY_ENV, build_parser
from duoka.config import load_config
from duoka.host.ports import parse_endpoint
from duoka.launch.cluster import resolve_launch
from duoka.parallel.dims import ParallelDims

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KINDS = {"duoka-train.yaml": ["ConfigMap", "Job", "PersistentVolumeClaim", "Service"],
         "duoka-serve.yaml": ["Deployment", "Service"]}
VERSIONS = ("1.31", kubernetes_validate.latest_version())


def load(name: str = "duoka-train.yaml") -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text())}


def pod_env(container: dict, index: int) -> dict[str, str]:
    """The variables duoka sees in pod `index`: the manifest's, and the Job controller's index."""
    return {**{e["name"]: e["value"] for e in container["env"]}, "JOB_COMPLETION_INDEX": str(index)}


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid(version, name):
    docs = load(name)
    assert sorted(docs) == KINDS[name]
    for doc in docs.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_broken_job():
    job = load()["Job"]
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["terminationGracePeriod"] = 300
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["completions"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_the_parts_agree():
    docs = load()
    job, service = docs["Job"], docs["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = pod_env(container, 0)
    nodes = int(env["PET_NNODES"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    # Pod 0's DNS name through the headless Service, on the port the Service and the pod open.
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = parse_endpoint(env["PET_RDZV_ENDPOINT"])
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert port == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    # A stop has time to save, and duoka's own limit comes before the kubelet's SIGKILL.
    assert 0 < int(env["DUOKA_SHUTDOWN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]
    # Shared memory in RAM, GPUs requested, the run on the shared volume and resumed after a restart.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    command = container["command"]
    assert command[:2] == ["duoka", "train"] and "--checkpoint.resume=auto" in command
    run_dir = next(a.split("=", 1)[1] for a in command if a.startswith("--job.output_dir="))
    data_mount = next(path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name])
    assert run_dir.startswith(data_mount + "/")
    assert volumes[mounts["/etc/duoka"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert Path(command[2]).parent == Path("/etc/duoka") and Path(command[2]).name in docs["ConfigMap"]["data"]
    # podFailurePolicy needs restartPolicy Never; exit code 2 (an error with its fix) ends the job.
    assert pod["restartPolicy"] == "Never"
    fail = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail[0]["onExitCodes"]["values"] == [2] and fail[0]["onExitCodes"]["containerName"] == container["name"]


def test_the_config_loads_and_fits_the_job(tmp_path):
    docs = load()
    config = tmp_path / "train.toml"
    config.write_text(docs["ConfigMap"]["data"]["train.toml"])
    cfg = load_config(config)
    (container,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    nodes = int(pod_env(container, 0)["PET_NNODES"])
    dims = ParallelDims.from_config(cfg.parallel, nodes * container["resources"]["limits"]["nvidia.com/gpu"])
    assert dims.dp_replicate == nodes  # HSDP: one replica per node, as the comment says


def test_each_pod_finds_its_place():
    job = load()["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    for index in range(job["spec"]["completions"]):
        launch = resolve_launch(pod_env(container, index))
        assert (launch.nnodes, launch.node_rank) == (job["spec"]["completions"], index)
        assert launch.rdzv_endpoint == "duoka-train-0.duoka-train:29500"
        assert launch.detected.startswith(f"duoka: Kubernetes Indexed Job: node {index} of 2 (JOB_COMPLETION_INDEX, "
                                          "PET_NNODES); rendezvous duoka-train-0.duoka-train:29500")


# ---------------------------------------------------------------- duoka-serve.yaml
def serve_parts():
    docs = load("duoka-serve.yaml")
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return docs, pod, container, build_parser().parse_args(container["command"][1:])


def test_the_serve_probes_reach_health_on_the_port_duoka_listens_on():
    docs, _, container, a = serve_parts()
    deployment, service = docs["Deployment"], docs["Service"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["command"][:2] == ["duoka", "serve"] and a.host == "0.0.0.0"
    assert list(ports.values()) == [a.port]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[kind]["httpGet"]
        assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == a.port, kind
    # A load of many minutes is the startupProbe's; liveness then restarts a dead engine within a minute.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    assert deployment["spec"]["progressDeadlineSeconds"] > startup["periodSeconds"] * startup["failureThreshold"]
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] <= 60
    # The Service: ClusterIP on 8000, to the same port, selecting the Deployment's pods.
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8000
    target = service["spec"]["ports"][0]["targetPort"]
    assert ports.get(target, target) == a.port
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]


def test_the_pod_outlasts_the_drain():
    """The kubelet's SIGKILL comes terminationGracePeriodSeconds after SIGTERM: by then duoka
    serve must have drained (--grace), settled the aborted requests, closed uvicorn and stopped
    the engine process, each at its longest."""
    from duoka.serve.async_engine import ABORT_SETTLE_S
    from duoka.serve.engine_process import STOP_TIMEOUT_S
    from duoka.serve.server import UVICORN_SHUTDOWN_S

    _, pod, container, a = serve_parts()
    stop = a.grace + ABORT_SETTLE_S + UVICORN_SHUTDOWN_S + STOP_TIMEOUT_S
    assert "--grace=60" in container["command"] and a.grace < stop < pod["terminationGracePeriodSeconds"]


def test_the_key_comes_from_the_secret_and_the_model_from_a_read_only_claim():
    _, pod, container, a = serve_parts()
    (key,) = [e for e in container["env"] if e["name"] == SERVE_API_KEY_ENV]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "duoka-serve", "key": "api-key"}
    assert a.api_key is None  # never in the manifest: duoka reads it from the environment
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if a.model.startswith(m["mountPath"] + "/")]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    assert mount["readOnly"] is True and claim["readOnly"] is True
    # The claim training writes to (ReadWriteMany: every replica mounts it, on any node).
    train_claim = load()["PersistentVolumeClaim"]
    assert claim["claimName"] == train_claim["metadata"]["name"] and "ReadWriteMany" in train_claim["spec"]["accessModes"]
