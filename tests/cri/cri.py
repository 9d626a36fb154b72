#!/usr/bin/env python3
"""A minimal CRI v1 client that plays kubelet against a container runtime's
unix socket (tests/cri.rs drives containerd 1.6's CRI plugin with it).

Needs grpcio and grpcio-tools (scripts/deps.sh --test installs them into
/opt/cube-network-agent-test/venv; run this with that venv's python). The
API is our own subset, tests/cri/cri_subset.proto (package runtime.v1, the
upstream field numbers), compiled when this starts by grpc_tools' protoc
into a temporary directory that is removed again.

    cri.py --sock SOCK version
    cri.py --sock SOCK status [--wait SECONDS]
    cri.py --sock SOCK image-status IMAGE
    cri.py --sock SOCK run-pod NAME [--namespace NS] [--uid UID] [--attempt N]
           [--port PROTO:HOST:CONTAINER[:HOST_IP]]... [--annotation K=V]...
           [--label K=V]... [--cgroup-parent P] [--log-dir D] [--hostname H]
    cri.py --sock SOCK pod-status ID
    cri.py --sock SOCK pods
    cri.py --sock SOCK create-start POD_ID NAME [--image I] [--attempt N] -- CMD...
    cri.py --sock SOCK exec CID [--timeout SECONDS] -- CMD...
    cri.py --sock SOCK stop-container CID
    cri.py --sock SOCK rm-container CID
    cri.py --sock SOCK stop-pod ID
    cri.py --sock SOCK rm-pod ID

Each prints one JSON object on stdout. A failed call exits 1 with
"cri.py: METHOD: CODE: DETAILS" on stderr; 2 is a usage error.

What a kubelet does that this follows: RunPodSandbox with metadata (name,
namespace, uid, attempt), hostname, port mappings, labels, annotations
(kubernetes.io/ingress-bandwidth and egress-bandwidth among them) and
linux.cgroup_parent with pod network/IPC namespaces; CreateContainer gets
the pod's config again (here read back from the runtime's verbose
PodSandboxStatus, which containerd fills with the config it was given).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

DEFAULT_IMAGE = "cube.test/busybox:1"
HERE = os.path.dirname(os.path.abspath(__file__))


def load_api():
    """Compiles cri_subset.proto into a temporary directory and imports the
    generated modules."""
    try:
        from grpc_tools import protoc
    except ImportError:
        sys.exit(
            "cri.py: grpc_tools missing (run with /opt/cube-network-agent-test/venv/bin/python; "
            "scripts/deps.sh --test installs grpcio and grpcio-tools there)"
        )
    out = tempfile.mkdtemp(prefix="cri-proto.")
    try:
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(
            [
                "protoc",
                f"-I{HERE}",
                f"-I{include}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                os.path.join(HERE, "cri_subset.proto"),
            ]
        )
        if rc != 0:
            sys.exit(f"cri.py: protoc failed on cri_subset.proto ({rc})")
        sys.path.insert(0, out)
        import cri_subset_pb2 as pb
        import cri_subset_pb2_grpc as pbg
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return pb, pbg


pb, pbg = load_api()
import grpc  # noqa: E402 (after the generated modules: same error message path)
from google.protobuf import json_format  # noqa: E402


class CallFailed(Exception):
    pass


class Cri:
    def __init__(self, sock, timeout):
        self.channel = grpc.insecure_channel(f"unix://{sock}")
        self.rt = pbg.RuntimeServiceStub(self.channel)
        self.img = pbg.ImageServiceStub(self.channel)
        self.timeout = timeout

    def call(self, stub, method, req, timeout=None):
        try:
            return getattr(stub, method)(req, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CallFailed(f"{method}: {e.code().name}: {e.details()}") from None


def as_dict(msg):
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def kv(items, what):
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"cri.py: {what} {item!r}: want KEY=VALUE")
        out[k] = v
    return out


def port(spec):
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise SystemExit(f"cri.py: --port {spec!r}: want PROTO:HOST:CONTAINER[:HOST_IP]")
    proto = {"tcp": pb.TCP, "udp": pb.UDP, "sctp": pb.SCTP}.get(parts[0].lower())
    if proto is None:
        raise SystemExit(f"cri.py: --port {spec!r}: protocol is tcp, udp or sctp")
    return pb.PortMapping(
        protocol=proto,
        host_port=int(parts[1]),
        container_port=int(parts[2]),
        host_ip=parts[3] if len(parts) == 4 else "",
    )


def pod_config(a):
    uid = a.uid or f"uid-{a.name}"
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(
            name=a.name, uid=uid, namespace=a.namespace, attempt=a.attempt
        ),
        hostname=a.hostname or a.name,
        log_directory=a.log_dir or "",
        dns_config=pb.DNSConfig(servers=[], searches=[], options=[]),
        port_mappings=[port(p) for p in a.port or []],
        labels={
            "io.kubernetes.pod.name": a.name,
            "io.kubernetes.pod.namespace": a.namespace,
            "io.kubernetes.pod.uid": uid,
            **kv(a.label, "--label"),
        },
        annotations=kv(a.annotation, "--annotation"),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=a.cgroup_parent or "",
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(
                    network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD
                )
            ),
        ),
    )


def verbose_info(resp):
    """containerd's verbose PodSandboxStatus: info["info"] is a JSON object
    (pid, config, cniResult, ...)."""
    raw = resp.info.get("info")
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def pod_status(c, pod_id):
    req = pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True)
    resp = c.call(c.rt, "PodSandboxStatus", req)
    st = resp.status
    info = verbose_info(resp)
    return {
        "id": st.id,
        "state": pb.PodSandboxState.Name(st.state),
        "ip": st.network.ip,
        "additional_ips": [x.ip for x in st.network.additional_ips],
        "metadata": as_dict(st.metadata),
        "annotations": dict(st.annotations),
        "labels": dict(st.labels),
        "pid": info.get("pid", 0),
        "cni_result": info.get("cniResult"),
        "config": info.get("config"),
    }


def sandbox_config_of(c, pod_id):
    """The pod's config as the runtime recorded it (kubelet keeps its own
    copy; containerd's verbose status hands it back)."""
    st = pod_status(c, pod_id)
    if not st["config"]:
        raise CallFailed(f"PodSandboxStatus: no config in the verbose info of {pod_id}")
    return json_format.ParseDict(st["config"], pb.PodSandboxConfig(), ignore_unknown_fields=True)


def cmd_status(c, a):
    deadline = time.monotonic() + (a.wait or 0)
    while True:
        resp = c.call(c.rt, "Status", pb.StatusRequest(verbose=False))
        conds = {
            x.type: {"status": x.status, "reason": x.reason, "message": x.message}
            for x in resp.status.conditions
        }
        ready = all(conds.get(t, {}).get("status") for t in ("RuntimeReady", "NetworkReady"))
        if ready or not a.wait or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if a.wait and not ready:
        raise CallFailed(f"Status: not ready after {a.wait} s: {json.dumps(conds)}")
    return {"conditions": conds, "ready": ready}


def cmd_create_start(c, a):
    if not a.cmd:
        raise SystemExit("cri.py: create-start: CMD missing")
    sandbox = sandbox_config_of(c, a.pod_id)
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=a.name, attempt=a.attempt),
        image=pb.ImageSpec(image=a.image),
        command=a.cmd,
        envs=[pb.KeyValue(key="PATH", value="/bin")],
        labels={"io.kubernetes.container.name": a.name},
    )
    resp = c.call(
        c.rt,
        "CreateContainer",
        pb.CreateContainerRequest(pod_sandbox_id=a.pod_id, config=cfg, sandbox_config=sandbox),
    )
    c.call(c.rt, "StartContainer", pb.StartContainerRequest(container_id=resp.container_id))
    return {"id": resp.container_id}


def cmd_exec(c, a):
    if not a.cmd:
        raise SystemExit("cri.py: exec: CMD missing")
    resp = c.call(
        c.rt,
        "ExecSync",
        pb.ExecSyncRequest(container_id=a.cid, cmd=a.cmd, timeout=a.timeout),
        timeout=a.timeout + 30 if a.timeout else None,
    )
    return {
        "exit_code": resp.exit_code,
        "stdout": resp.stdout.decode(errors="replace"),
        "stderr": resp.stderr.decode(errors="replace"),
    }


def main():
    p = argparse.ArgumentParser(prog="cri.py", description="a minimal CRI v1 client")
    p.add_argument("--sock", required=True, help="the runtime's CRI unix socket")
    p.add_argument("--call-timeout", type=float, default=60.0, help="seconds per call (default 60)")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("version")
    s = sub.add_parser("status")
    s.add_argument("--wait", type=float, default=0, help="poll until RuntimeReady and NetworkReady")
    s = sub.add_parser("image-status")
    s.add_argument("image")
    s = sub.add_parser("run-pod")
    s.add_argument("name")
    s.add_argument("--namespace", default="default")
    s.add_argument("--uid")
    s.add_argument("--attempt", type=int, default=0)
    s.add_argument("--port", action="append", metavar="PROTO:HOST:CONTAINER[:HOST_IP]")
    s.add_argument("--annotation", action="append", metavar="K=V")
    s.add_argument("--label", action="append", metavar="K=V")
    s.add_argument("--cgroup-parent")
    s.add_argument("--log-dir")
    s.add_argument("--hostname")
    for name in ("pod-status", "stop-pod", "rm-pod"):
        sub.add_parser(name).add_argument("id")
    sub.add_parser("pods")
    s = sub.add_parser("create-start")
    s.add_argument("pod_id")
    s.add_argument("name")
    s.add_argument("--image", default=DEFAULT_IMAGE)
    s.add_argument("--attempt", type=int, default=0)
    s = sub.add_parser("exec")
    s.add_argument("cid")
    s.add_argument("--timeout", type=int, default=30, help="seconds (default 30)")
    for name in ("stop-container", "rm-container"):
        sub.add_parser(name).add_argument("cid")
    # A command (create-start, exec) follows "--", after every option.
    argv = sys.argv[1:]
    cmd = []
    if "--" in argv:
        cmd = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    a = p.parse_args(argv)
    a.cmd = cmd

    c = Cri(a.sock, a.call_timeout)
    try:
        if a.what == "version":
            r = c.call(c.rt, "Version", pb.VersionRequest(version="v1"))
            out = as_dict(r)
        elif a.what == "status":
            out = cmd_status(c, a)
        elif a.what == "image-status":
            req = pb.ImageStatusRequest(image=pb.ImageSpec(image=a.image))
            r = c.call(c.img, "ImageStatus", req)
            out = as_dict(r.image)
        elif a.what == "run-pod":
            r = c.call(c.rt, "RunPodSandbox", pb.RunPodSandboxRequest(config=pod_config(a)))
            out = {"id": r.pod_sandbox_id}
        elif a.what == "pod-status":
            out = pod_status(c, a.id)
        elif a.what == "pods":
            r = c.call(c.rt, "ListPodSandbox", pb.ListPodSandboxRequest())
            out = {
                "items": [
                    {
                        "id": x.id,
                        "state": pb.PodSandboxState.Name(x.state),
                        "metadata": as_dict(x.metadata),
                    }
                    for x in r.items
                ]
            }
        elif a.what == "create-start":
            out = cmd_create_start(c, a)
        elif a.what == "exec":
            out = cmd_exec(c, a)
        elif a.what == "stop-container":
            c.call(c.rt, "StopContainer", pb.StopContainerRequest(container_id=a.cid, timeout=0))
            out = {}
        elif a.what == "rm-container":
            c.call(c.rt, "RemoveContainer", pb.RemoveContainerRequest(container_id=a.cid))
            out = {}
        elif a.what == "stop-pod":
            c.call(c.rt, "StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=a.id))
            out = {}
        elif a.what == "rm-pod":
            c.call(c.rt, "RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=a.id))
            out = {}
    except CallFailed as e:
        print(f"cri.py: {e}", file=sys.stderr)
        return 1
    finally:
        c.channel.close()
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
