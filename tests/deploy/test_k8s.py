"""deploy/k8s: every overlay renders with ``kubectl kustomize`` and every object validates
against the Kubernetes 1.32 schemas offline (strict: unknown fields refused); the workloads
agree with the config they mount (ports, probes, master peers, the token Secret) and their
command lines are ones gcache accepts."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from gcache import cli
from gcache.ops.config import check_text

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.32.0"
OVERLAYS = ("dev", "gpu", "rdma")

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (dev extra)")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) is not installed")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders the kustomizations)")
    tree = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, tree)
    (tree / "overlays" / "gpu" / "token.txt").write_text(secrets.token_hex(32) + "\n")
    out = {}
    for name in ("base", *OVERLAYS):
        path = tree / "base" if name == "base" else tree / "overlays" / name
        p = subprocess.run(["kubectl", "kustomize", str(path)], check=False, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, f"{name}: {p.stderr}"
        out[name] = [d for d in yaml.safe_load_all(p.stdout) if d]
    return out


def one(docs: list[dict], kind: str, name: str) -> dict:
    (obj,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    return obj


def toml_of(docs: list[dict]) -> dict:
    cm = one(docs, "ConfigMap", "gcache-config")
    return tomllib.loads(cm["data"]["gcache.toml"])


def test_every_object_is_valid_against_the_schemas(rendered):
    import jsonschema

    sm_schema = json.loads((ROOT / "tests" / "data" / "servicemonitor-v1.schema.json").read_text())
    counted = 0
    for name, docs in rendered.items():
        for d in docs:
            if d["kind"] == "ServiceMonitor":  # a CRD: not in the core schemas
                jsonschema.validate(d, sm_schema)
            else:
                try:
                    kv.validate(d, KUBE_VERSION, strict=True)
                except kv.ValidationError as exc:
                    raise AssertionError(f"{name}: {d['kind']}/{d['metadata']['name']}: {exc.message} "
                                         f"at {list(exc.path)}") from None
            counted += 1
    assert counted >= 50


def test_the_validator_refuses_an_unknown_field(rendered):
    ds = json.loads(json.dumps(one(rendered["dev"], "DaemonSet", "gcached")))
    ds["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, KUBE_VERSION, strict=True)


def test_each_overlay_has_what_a_fleet_needs(rendered):
    for name in OVERLAYS:
        docs = rendered[name]
        kinds = {(d["kind"], d["metadata"]["name"].split("-")[0] if d["kind"] in ("Secret", "ConfigMap")
                  else d["metadata"]["name"]) for d in docs}
        for need in [("DaemonSet", "gcached"), ("StatefulSet", "gcache-master"), ("Service", "gcache-master"),
                     ("Deployment", "gcache-router"), ("Deployment", "gcache-redis"), ("Service", "gcache-redis"),
                     ("PodDisruptionBudget", "gcached"), ("PodDisruptionBudget", "gcache-master"),
                     ("PodDisruptionBudget", "gcache-router"), ("Secret", "gcache"), ("ConfigMap", "gcache")]:
            assert need in kinds, f"{name}: no {need}"
        assert all(d["metadata"].get("namespace") == "gcache" for d in docs if d["kind"] != "Namespace")
    assert any(d["kind"] == "ServiceMonitor" for d in rendered["gpu"])


def test_config_maps_are_valid_gcache_configs(rendered):
    for name, docs in rendered.items():
        _, problems = check_text(one(docs, "ConfigMap", "gcache-config")["data"]["gcache.toml"])
        assert not problems, f"{name}: " + "; ".join(p.format("gcache.toml") for p in problems)
    assert toml_of(rendered["gpu"])["daemon"]["mem"] == "64GiB"
    assert toml_of(rendered["rdma"])["daemon"]["ucx"] is True


def test_daemonset_probes_drain_and_host_resources_match_the_config(rendered):
    for name in OVERLAYS:
        docs = rendered[name]
        cfg = toml_of(docs)
        pod = one(docs, "DaemonSet", "gcached")["spec"]["template"]["spec"]
        assert pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        c = next(c for c in pod["containers"] if c["name"] == "gcached")
        port = cfg["daemon"]["metrics_port"]
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
        assert "gcache drain" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert pod["terminationGracePeriodSeconds"] >= 240
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        nvme = next(v for v in pod["volumes"] if v["name"] == "nvme")
        mount = next(m for m in c["volumeMounts"] if m["name"] == "nvme")
        assert "hostPath" in nvme and mount["mountPath"] == cfg["daemon"]["disk"]
        # the pod's memory limit holds the arena
        from gcache.sizes import parse_size

        limit = c["resources"]["limits"]["memory"]
        assert parse_size(limit.replace("Gi", "GiB").replace("Mi", "MiB")) > parse_size(cfg["daemon"]["mem"])
        secret = next(v for v in pod["volumes"] if v["name"] == "token")["secret"]["secretName"]
        assert secret == one(docs, "Secret", "gcache-token")["metadata"]["name"]
        assert cfg["cluster"]["token_file"].startswith(next(
            m["mountPath"] for m in c["volumeMounts"] if m["name"] == "token"))
    rdma = one(rendered["rdma"], "DaemonSet", "gcached")["spec"]["template"]["spec"]["containers"][0]
    assert rdma["resources"]["limits"]["hugepages-2Mi"] == "2Gi"


def test_masters_have_stable_raft_addresses_matching_the_peers(rendered):
    docs = rendered["gpu"]
    cfg = toml_of(docs)
    sts = one(docs, "StatefulSet", "gcache-master")
    svc = one(docs, "Service", "gcache-master")
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    ns = sts["metadata"]["namespace"]
    expect = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}.{ns}.svc.cluster.local" for i in range(3)]
    assert [p.rsplit(":", 1)[0] for p in cfg["master"]["peers"]] == expect
    assert [m.rsplit(":", 1)[0] for m in cfg["cluster"]["masters"]] == expect
    c = sts["spec"]["template"]["spec"]["containers"][0]
    raft = next(a for a in c["args"] if a.startswith("--raft="))
    assert raft.replace("$(POD_NAME)", f"{sts['metadata']['name']}-1").replace("$(POD_NAMESPACE)", ns) \
        == "--raft=" + cfg["master"]["peers"][1]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert one(docs, "PodDisruptionBudget", "gcache-master")["spec"]["maxUnavailable"] == 1


def test_container_command_lines_are_accepted(rendered, tmp_path, monkeypatch):
    import router.cli as rcli

    docs = rendered["gpu"]
    conf = tmp_path / "gcache.toml"
    conf.write_text(one(docs, "ConfigMap", "gcache-config")["data"]["gcache.toml"])
    env = {"POD_NAME": "gcache-master-0", "POD_NAMESPACE": "gcache", "NODE_NAME": "gpu-a", "HOST_IP": "10.0.0.11"}

    def expand(args: list[str]) -> list[str]:
        return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a).replace("/etc/gcache/gcache.toml", str(conf))
                for a in args]

    seen = []
    monkeypatch.setattr(rcli, "serve", lambda a: seen.append(a) or 0)
    for kind, name in (("DaemonSet", "gcached"), ("StatefulSet", "gcache-master"), ("Deployment", "gcache-router")):
        c = one(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
        args = expand(c["args"])
        if c.get("command") == ["gcache-router"]:
            assert rcli.main(args) == 0 and seen[-1].port == 8000
            continue
        parser = cli.build_parser()
        cli._apply_config(parser, args)
        a = parser.parse_args(args)
        if a.cmd == "daemon":
            assert (a.listen, a.node_id, a.mem, a.metrics_port) == ("10.0.0.11:7400", "gpu-a", "64GiB", 9400)
            stop = expand(c["lifecycle"]["preStop"]["exec"]["command"][2].replace('"$NODE_NAME"', "$(NODE_NAME)")
                          .split()[2:])
            parser = cli.build_parser()
            cli._apply_config(parser, stop)
            d = parser.parse_args(stop)
            assert d.cmd == "drain" and d.node == "gpu-a" and d.masters.startswith("gcache://gcache-master-0.")
        else:
            assert a.raft.startswith("gcache-master-0.gcache-master.gcache.svc") and a.id == "gcache-master-0"
