"""Evaluates the admission guards on cert-manager's csi-driver (run by
check.sh, from deploy/).

Two ValidatingAdmissionPolicies decide which pods in the namespace may mount
cert-manager's csi-driver, and for which identity:
kubernetes/agent-identity-policy.yaml (the agents: node identities, for the
node the pod is bound to) and kubernetes/server-identity-policy.yaml (the
server replicas: the serving certificate and spiffe://fairplace/replica/POD).
Their CEL expressions are evaluated here, as written, with cel-python,
against the pods the controllers make from kubernetes/agent-daemonset.yaml
(bound to its node and completed by the mutating policy, as the API server
would) and kubernetes/server-statefulset.yaml, and against pods an attacker
in the namespace could submit. A pod is admitted when every guard whose
match conditions it meets admits it. The controllers' pods must be
admitted, each forged one denied, naming why.
"""
import copy
import sys

import celpy
import yaml

DS_CONTROLLER = "system:serviceaccount:kube-system:daemon-set-controller"
STS_CONTROLLER = "system:serviceaccount:kube-system:statefulset-controller"

guards = []
for f in ("kubernetes/agent-identity-policy.yaml", "kubernetes/server-identity-policy.yaml"):
    guards += [(d["metadata"]["name"], d["spec"]) for d in yaml.safe_load_all(open(f))
               if d and d["kind"] == "ValidatingAdmissionPolicy"]
ds = yaml.safe_load(open("kubernetes/agent-daemonset.yaml"))
sts = yaml.safe_load(open("kubernetes/server-statefulset.yaml"))
env = celpy.Environment()


def run(expr, activation):
    return env.program(env.compile(expr)).evaluate(activation)


def admit(pod, user):
    """None when admitted (or no guard's business), else the guard and the
    message of the first failed validation."""
    act = {"object": celpy.json_to_cel(pod),
           "request": celpy.json_to_cel({"userInfo": {"username": user}})}
    for name, guard in guards:
        act.pop("variables", None)
        if not all(bool(run(c["expression"], act)) for c in guard.get("matchConditions", [])):
            continue
        variables = {}
        for v in guard.get("variables", []):
            act["variables"] = celpy.celtypes.MapType(variables)
            variables[celpy.celtypes.StringType(v["name"])] = run(v["expression"], act)
        act["variables"] = celpy.celtypes.MapType(variables)
        for v in guard["validations"]:
            result = run(v["expression"], act)
            if isinstance(result, celpy.CELEvalError) or not bool(result):
                return f"{name}: {v.get('message', v['expression'])}"
    return None


def agent_pod(node):
    """The pod the DaemonSet controller creates for `node`, after the
    mutating policy filled in the node's URI."""
    pod = {"metadata": copy.deepcopy(ds["spec"]["template"]["metadata"]),
           "spec": copy.deepcopy(ds["spec"]["template"]["spec"])}
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                                           "name": ds["metadata"]["name"], "uid": "u", "controller": True,
                                           "blockOwnerDeletion": True}]
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    for v in pod["spec"]["volumes"]:
        if v.get("csi", {}).get("driver") == "csi.cert-manager.io":
            v["csi"]["volumeAttributes"]["csi.cert-manager.io/uri-sans"] = f"spiffe://fairplace/node/{node}"
    return pod


def server_pod(ordinal):
    """The pod the StatefulSet controller creates for `ordinal` (its csi
    volumes as written: the csi-driver, not admission, fills in the pod's
    name when it mounts them)."""
    pod = {"metadata": copy.deepcopy(sts["spec"]["template"]["metadata"]),
           "spec": copy.deepcopy(sts["spec"]["template"]["spec"])}
    pod["metadata"]["name"] = f"{sts['metadata']['name']}-{ordinal}"
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                           "name": sts["metadata"]["name"], "uid": "u", "controller": True,
                                           "blockOwnerDeletion": True}]
    return pod


def attrs(pod, name=None):
    return next(v["csi"]["volumeAttributes"] for v in pod["spec"]["volumes"]
                if v.get("csi", {}).get("driver") == "csi.cert-manager.io" and name in (None, v["name"]))


errors = []
for what, pod, user in (("the DaemonSet's own pod", agent_pod("worker-1"), DS_CONTROLLER),
                        ("the server StatefulSet's own pod", server_pod(1), STS_CONTROLLER)):
    why = admit(pod, user)
    if why:
        errors.append(f"{what} is refused: {why}")
    else:
        print(f"admitted as it must be: {what}")


def forged(what, make, user, change=lambda p: None):
    pod = make()
    change(pod)
    why = admit(pod, user)
    if why is None:
        errors.append(f"admitted: {what}")
    else:
        print(f"denied as it must be: {what}: {' '.join(why.split())}")


def agent(what, user=DS_CONTROLLER, change=lambda p: None):
    forged(f"agent pod: {what}", lambda: agent_pod("worker-1"), user, change)


def server(what, user=STS_CONTROLLER, change=lambda p: None):
    forged(f"server pod: {what}", lambda: server_pod(1), user, change)


agent("a pod created by the namespace's own service account", user="system:serviceaccount:fairplace:default")
agent("a pod created by a user", user="mallory")
agent("another node's URI", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/node/worker-2"}))
agent("an admin URI", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/admin/operator"}))
agent("a replica URI", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/replica/${POD_NAME}"}))
agent("a DNS name besides", change=lambda p: attrs(p).update({"csi.cert-manager.io/dns-names": "fairplace-server"}))
agent("server auth", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/key-usages": "server auth,digital signature"}))
agent("a CA", change=lambda p: attrs(p).update({"csi.cert-manager.io/is-ca": "true"}))
agent("no owner", change=lambda p: p["metadata"].pop("ownerReferences"))
agent("owned by another DaemonSet", change=lambda p: p["metadata"]["ownerReferences"][0].update({"name": "other"}))
agent("bound to no node", change=lambda p: p["spec"].pop("affinity"))
agent("bound to two nodes", change=lambda p: p["spec"]["affinity"]["nodeAffinity"][
    "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchFields"][0].update(
    {"values": ["worker-1", "worker-2"]}))
# Claiming a StatefulSet owner moves a pod to the server guard, which checks who created it.
agent("claiming to be a StatefulSet's pod", user="mallory",
      change=lambda p: p["metadata"]["ownerReferences"][0].update({"kind": "StatefulSet", "name": "fairplace-server"}))

server("a pod created by the namespace's own service account", user="system:serviceaccount:fairplace:default")
server("a pod created by a user", user="mallory")
server("created by the DaemonSet controller", user=DS_CONTROLLER)
server("owned by another StatefulSet", change=lambda p: p["metadata"]["ownerReferences"][0].update({"name": "other"}))
server("a name not of the StatefulSet", change=lambda p: p["metadata"].update({"name": "web-0"}))
server("another replica's URI written out", change=lambda p: attrs(p, "replica-tls").update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/replica/fairplace-server-0"}))
server("an admin URI", change=lambda p: attrs(p, "replica-tls").update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/admin/operator"}))
server("a node URI", change=lambda p: attrs(p, "etcd-tls").update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/node/worker-1"}))
server("a foreign DNS name on the serving certificate", change=lambda p: attrs(p, "server-tls").update(
    {"csi.cert-manager.io/dns-names": attrs(p, "server-tls")["csi.cert-manager.io/dns-names"] + ",example.com"}))
server("another replica's DNS name", change=lambda p: attrs(p, "server-tls").update(
    {"csi.cert-manager.io/dns-names": "fairplace-server-0.fairplace-server-peers.fairplace.svc"}))
server("client auth on the serving certificate", change=lambda p: attrs(p, "server-tls").update(
    {"csi.cert-manager.io/key-usages": "server auth,client auth,digital signature"}))
server("server auth on the replica certificate", change=lambda p: attrs(p, "replica-tls").update(
    {"csi.cert-manager.io/key-usages": "server auth,digital signature"}))
server("a DNS name on the replica certificate", change=lambda p: attrs(p, "replica-tls").update(
    {"csi.cert-manager.io/dns-names": "fairplace-server"}))
server("the serving certificate from etcd's CA", change=lambda p: attrs(p, "server-tls").update(
    {"csi.cert-manager.io/issuer-name": "fairplace-etcd-ca"}))
server("another issuer", change=lambda p: attrs(p, "etcd-tls").update(
    {"csi.cert-manager.io/issuer-name": "fairplace-selfsigned"}))
server("a ClusterIssuer", change=lambda p: attrs(p, "etcd-tls").update(
    {"csi.cert-manager.io/issuer-kind": "ClusterIssuer"}))
server("a CA", change=lambda p: attrs(p, "replica-tls").update({"csi.cert-manager.io/is-ca": "true"}))
server("a common name", change=lambda p: attrs(p, "etcd-tls").update({"csi.cert-manager.io/common-name": "root"}))
server("a literal subject", change=lambda p: attrs(p, "etcd-tls").update(
    {"csi.cert-manager.io/literal-subject": "CN=root"}))
server("an IP address", change=lambda p: attrs(p, "server-tls").update({"csi.cert-manager.io/ip-sans": "10.0.0.1"}))
server("a fourth volume, an agent's", change=lambda p: p["spec"]["volumes"].append(
    copy.deepcopy(next(v for v in agent_pod("worker-1")["spec"]["volumes"] if v["name"] == "agent-tls"))))

plain = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c", "image": "x"}], "volumes": []}}
if admit(plain, "mallory") is not None:
    errors.append("a pod without the csi-driver is refused: the guards must leave it alone")
etcd_like = server_pod(0)
etcd_like["spec"]["volumes"] = [v for v in etcd_like["spec"]["volumes"] if "csi" not in v]
if admit(etcd_like, STS_CONTROLLER) is not None:
    errors.append("a StatefulSet pod without the csi-driver (etcd's) is refused: the guards must leave it alone")

if errors:
    print("\n".join("FAIL " + e for e in errors))
    sys.exit(1)
print("admission guards OK: the DaemonSet's and the server StatefulSet's pods admitted, every forged one "
      "denied, other pods untouched")
