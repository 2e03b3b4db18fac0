"""Evaluates the agents' admission guard (run by check.sh, from deploy/).

kubernetes/agent-identity-policy.yaml's ValidatingAdmissionPolicy decides
which pods in the namespace may mount cert-manager's csi-driver, and for
which node. Its CEL expressions are evaluated here, as written, with
cel-python, against the pod the DaemonSet controller makes from
kubernetes/agent-daemonset.yaml (bound to its node and completed by the
mutating policy, as the API server would) and against pods an attacker in
the namespace could submit. The guard must admit the first and deny each
of the others, naming why.
"""
import copy
import sys

import celpy
import yaml

DS_CONTROLLER = "system:serviceaccount:kube-system:daemon-set-controller"

docs = [d for d in yaml.safe_load_all(open("kubernetes/agent-identity-policy.yaml")) if d]
guard = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")["spec"]
ds = yaml.safe_load(open("kubernetes/agent-daemonset.yaml"))
env = celpy.Environment()


def run(expr, activation):
    return env.program(env.compile(expr)).evaluate(activation)


def admit(pod, user):
    """None when admitted (or not the guard's business), else the message of
    the first failed validation."""
    act = {"object": celpy.json_to_cel(pod),
           "request": celpy.json_to_cel({"userInfo": {"username": user}})}
    if not all(bool(run(c["expression"], act)) for c in guard.get("matchConditions", [])):
        return None
    variables = {}
    for v in guard.get("variables", []):
        act["variables"] = celpy.celtypes.MapType(variables)
        variables[celpy.celtypes.StringType(v["name"])] = run(v["expression"], act)
    act["variables"] = celpy.celtypes.MapType(variables)
    for v in guard["validations"]:
        result = run(v["expression"], act)
        if isinstance(result, celpy.CELEvalError) or not bool(result):
            return v.get("message", v["expression"])
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


def attrs(pod):
    return next(v["csi"]["volumeAttributes"] for v in pod["spec"]["volumes"]
                if v.get("csi", {}).get("driver") == "csi.cert-manager.io")


errors = []
ok = agent_pod("worker-1")
why = admit(ok, DS_CONTROLLER)
if why:
    errors.append(f"the DaemonSet's own pod is refused: {why}")


def forged(what, user=DS_CONTROLLER, change=lambda p: None):
    pod = agent_pod("worker-1")
    change(pod)
    why = admit(pod, user)
    if why is None:
        errors.append(f"admitted: {what}")
    else:
        print(f"denied as it must be: {what}: {' '.join(why.split())}")


forged("a pod created by the namespace's own service account",
       user="system:serviceaccount:fairplace:default")
forged("a pod created by a user", user="mallory")
forged("another node's URI", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/node/worker-2"}))
forged("an admin URI", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/uri-sans": "spiffe://fairplace/admin/operator"}))
forged("a DNS name besides", change=lambda p: attrs(p).update({"csi.cert-manager.io/dns-names": "fairplace-server"}))
forged("server auth", change=lambda p: attrs(p).update(
    {"csi.cert-manager.io/key-usages": "server auth,digital signature"}))
forged("a CA", change=lambda p: attrs(p).update({"csi.cert-manager.io/is-ca": "true"}))
forged("no owner", change=lambda p: p["metadata"].pop("ownerReferences"))
forged("owned by another DaemonSet", change=lambda p: p["metadata"]["ownerReferences"][0].update({"name": "other"}))
forged("bound to no node", change=lambda p: p["spec"].pop("affinity"))
forged("bound to two nodes", change=lambda p: p["spec"]["affinity"]["nodeAffinity"][
    "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchFields"][0].update(
    {"values": ["worker-1", "worker-2"]}))
plain = {"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c", "image": "x"}], "volumes": []}}
if admit(plain, "mallory") is not None:
    errors.append("a pod without the csi-driver is refused: the guard must leave it alone")

if errors:
    print("\n".join("FAIL " + e for e in errors))
    sys.exit(1)
print("admission guard OK: the DaemonSet's pod admitted, every forged one denied, other pods untouched")
