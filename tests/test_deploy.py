"""deploy/kubernetes and the Containerfile: the manifests validate offline
against the Kubernetes API schemas (kubernetes-validate, strict) and the
ServiceMonitor against prometheus-operator's CRD (cloudcoil's models,
generated from its openAPI schema); the pieces name each other
consistently, and match the systemd unit and the sample configuration.

The image build itself (scripts/image) takes minutes and the network: it is
not run here."""

import os
import re
import stat
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

from mmtrace.agent.config.settings import DaemonConfig, load_config
from unit_file import service_settings

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
CONTAINERFILE = ROOT / "Containerfile"
SAMPLE_CONFIG = ROOT / "systemd" / "mmtrace.toml"
METRICS_PORT = 9464                 # the interface spec's default endpoint
# appArmorProfile in a securityContext is a field since 1.30.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def manifests() -> dict[str, dict]:
    """Every resource in deploy/kubernetes by kind."""
    out = {}
    for path in sorted(KUBE.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} resources"
            out[doc["kind"]] = doc
    return out


def core(kind: str) -> dict:
    return manifests()[kind]


def pod_spec() -> dict:
    return core("DaemonSet")["spec"]["template"]["spec"]


def container() -> dict:
    (only,) = pod_spec()["containers"]
    return only


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_resources_validate_strictly(version):
    kinds = {k: doc for k, doc in manifests().items() if k != "ServiceMonitor"}
    assert set(kinds) == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service"}
    for doc in kinds.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_a_misspelt_field():
    daemonset = core("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    spec["hostPid"] = spec.pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)


def validate_service_monitor(doc: dict):
    """The CRD's schema through its generated model; a key the model does not
    know is dropped by it, so the round trip must give the document back."""
    model = ServiceMonitor.model_validate(doc)
    again = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert again == doc, "fields the CRD does not define"


def test_service_monitor_matches_the_crd():
    validate_service_monitor(core("ServiceMonitor"))


@pytest.mark.parametrize("break_it", [
    lambda ep: ep.update(intervall=ep.pop("interval")),     # unknown field
    lambda ep: ep.update(interval="15 seconds"),            # not a duration
    lambda ep: ep.update(port=METRICS_PORT),                # a name, not a number
])
def test_service_monitor_check_catches_mistakes(break_it):
    doc = core("ServiceMonitor")
    break_it(doc["spec"]["endpoints"][0])
    with pytest.raises(Exception):
        validate_service_monitor(doc)


def test_kustomization_applies_every_manifest_namespace_first():
    listed = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    files = sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == files
    assert listed[0] == "namespace.yaml" and listed[-1] == "servicemonitor.yaml"


def test_everything_lives_in_the_namespace():
    namespace = core("Namespace")["metadata"]["name"]
    for kind, doc in manifests().items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, kind


def test_configmap_is_the_sample_configuration(tmp_path):
    text = core("ConfigMap")["data"]["mmtrace.toml"]
    assert tomllib.loads(text) == tomllib.loads(SAMPLE_CONFIG.read_text()), \
        "copy systemd/mmtrace.toml into deploy/kubernetes/configmap.yaml"
    copy = tmp_path / "mmtrace.toml"
    copy.write_text(text)
    assert load_config(copy) == DaemonConfig()


def test_daemonset_mounts_what_the_configuration_names():
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    config = load_config(SAMPLE_CONFIG)
    args = container()["args"]
    config_path = Path(args[args.index("--config") + 1])
    assert Path(mounts["config"]["mountPath"]) == config_path.parent
    assert volumes["config"]["configMap"]["name"] == core("ConfigMap")["metadata"]["name"]
    assert config_path.name in core("ConfigMap")["data"]
    assert Path(mounts["socket-dir"]["mountPath"]) == config.socket.parent
    assert volumes["socket-dir"]["hostPath"]["path"] == str(config.socket.parent)
    assert Path(mounts["state"]["mountPath"]) == config.state_dir
    # Tracefs and headers are only read.
    for name in ("debugfs", "tracefs", "modules", "usr-src"):
        assert mounts[name]["readOnly"] is True, name
    assert mounts["debugfs"]["mountPath"] == "/sys/kernel/debug"


def test_daemonset_holds_the_units_capabilities_and_no_more():
    security = container()["securityContext"]
    unit_caps = service_settings()["AmbientCapabilities"][0].split()
    assert security["capabilities"]["drop"] == ["ALL"]
    assert sorted(security["capabilities"]["add"]) == sorted(c.removeprefix("CAP_")
                                                             for c in unit_caps)
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert pod_spec()["hostPID"] is True
    assert pod_spec()["hostNetwork"] is False
    assert pod_spec()["serviceAccountName"] == core("ServiceAccount")["metadata"]["name"]


def test_metrics_port_is_probed_annotated_served_and_monitored():
    config = tomllib.loads(SAMPLE_CONFIG.read_text())
    assert config.get("metrics_address", f":{METRICS_PORT}").endswith(f":{METRICS_PORT}")
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"metrics": METRICS_PORT}
    annotations = core("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert container()["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    service = core("Service")
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = core("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "metrics"
    monitor = core("ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == [service_port["name"]]


def init_container() -> dict:
    (only,) = pod_spec()["initContainers"]
    return only


def test_host_directories_get_the_units_modes_and_the_socket_group():
    command = init_container()["command"][-1]
    settings = service_settings()
    group = container()["securityContext"]["runAsGroup"]
    assert init_container()["securityContext"]["runAsGroup"] == group
    assert f"chmod {settings['StateDirectoryMode'][0]} /var/lib/mmtrace" in command
    assert f"chmod {settings['RuntimeDirectoryMode'][0]} /run/mmtrace" in command
    assert f"chgrp {group} /run/mmtrace" in command
    assert init_container()["image"] == container()["image"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to uid 0 without capabilities")
def test_init_command_needs_no_capability(tmp_path):
    """As the init container runs it: uid 0, its group, no capabilities, on
    directories that root owns as the kubelet creates them."""
    state, run = tmp_path / "var/lib/mmtrace", tmp_path / "run/mmtrace"
    for d in (state, run):
        d.mkdir(parents=True, mode=0o755)
        os.chown(d, 0, 0)
    command = (init_container()["command"][-1].replace("/var/lib/mmtrace", str(state))
               .replace("/run/mmtrace", str(run)))
    group = init_container()["securityContext"]["runAsGroup"]
    result = subprocess.run(["setpriv", "--reuid=0", f"--regid={group}", "--clear-groups",
                             "--inh-caps=-all", "--bounding-set=-all", "--", "/bin/sh", "-c",
                             command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.stat().st_mode) == 0o750 and run.stat().st_gid == group


def test_resources_are_bounded():
    resources = container()["resources"]
    limit = resources["limits"]["memory"]
    assert limit == service_settings()["MemoryMax"][0].replace("M", "Mi")
    assert set(resources["requests"]) == {"cpu", "memory"}


# ----- the Containerfile (static: the build itself is scripts/image) -------

def containerfile() -> str:
    return CONTAINERFILE.read_text()


def test_containerfile_builds_from_a_local_debian_base():
    text = containerfile()
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M).group(1)
    assert base.startswith("localhost/") and "bookworm" in base
    assert "docker.io" not in text


def test_containerfile_installs_debians_bcc_and_the_pinned_environment():
    text = containerfile()
    assert re.search(r"apt-get install[^\n]*(\\\n[^\n]*)*python3-bpfcc", text)
    assert "python3 -m venv --system-site-packages /opt/mmtrace/.venv" in text
    assert "COPY requirements.txt /opt/mmtrace/requirements.txt" in text
    assert "pip install -q -r /opt/mmtrace/requirements.txt" in text
    assert re.search(r"pip install -q --no-deps /opt/mmtrace/src", text)
    # Every package the project installs is copied in.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
        assert f"COPY {folder} /opt/mmtrace/src/{folder}" in text, folder


def test_containerfile_runs_the_daemon_like_the_unit_and_the_daemonset():
    text = containerfile()
    entry = re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)
    cmd = re.search(r"^CMD (.+)$", text, re.M).group(1)
    assert yaml.safe_load(entry) == ["/opt/mmtrace/.venv/bin/mmtrace", "run"]
    assert yaml.safe_load(cmd) == container()["args"]
    exec_start = service_settings()["ExecStart"][0].split()
    assert exec_start == yaml.safe_load(entry) + container()["args"]
    assert "COPY systemd/mmtrace.toml /etc/mmtrace/mmtrace.toml" in text


def test_image_script_is_sound_bash():
    script = ROOT / "scripts" / "image"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = subprocess.run([str(script), "--no-such-flag"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument --no-such-flag" in out.stderr
