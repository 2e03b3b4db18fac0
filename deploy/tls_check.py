"""Static checks of the mutual-TLS deployment (run by check.sh, from deploy/).

cert-manager's Issuer and Certificate are validated against the subset of
their v1 CRD schemas these manifests use (unknown fields fail), and the
manifests are checked against each other: the server's TLS flags point into
the mounted Secret of its Certificate, the probes use the plaintext
health-only port, the agents' csi-driver volume asks the CA issuer for a
node identity that the admission policy completes, and every SPIFFE ID is
in the server's trust domain with a known role.
"""
import fnmatch
import glob
import re
import sys

import jsonschema
import yaml

DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(h|m|s))+$"}
ISSUER_REF = {
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {"name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                   "group": {"const": "cert-manager.io"}},
}
USAGES = ["signing", "digital signature", "content commitment", "key encipherment", "key agreement",
          "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
          "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
          "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
META = {"type": "object", "required": ["name"],
        "properties": {"name": {"type": "string"}, "labels": {"type": "object"},
                       "annotations": {"type": "object"}, "namespace": {"type": "string"}},
        "additionalProperties": False}
SCHEMAS = {
    "Issuer": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Issuer"}, "metadata": META,
            "spec": {"type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
                     "properties": {
                         "selfSigned": {"type": "object", "additionalProperties": False,
                                        "properties": {"crlDistributionPoints": {"type": "array"}}},
                         "ca": {"type": "object", "additionalProperties": False, "required": ["secretName"],
                                "properties": {"secretName": {"type": "string"}}}}},
        },
    },
    "Certificate": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"}, "metadata": META,
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["secretName", "issuerRef"],
                "properties": {
                    "secretName": {"type": "string"}, "commonName": {"type": "string", "maxLength": 64},
                    "dnsNames": {"type": "array", "items": {"type": "string"}},
                    "uris": {"type": "array", "items": {"type": "string"}},
                    "ipAddresses": {"type": "array", "items": {"type": "string"}},
                    "duration": DURATION, "renewBefore": DURATION, "isCA": {"type": "boolean"},
                    "usages": {"type": "array", "items": {"enum": USAGES}},
                    "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"},
                        "encoding": {"enum": ["PKCS1", "PKCS8"]}, "rotationPolicy": {"enum": ["Never", "Always"]}}},
                    "issuerRef": ISSUER_REF,
                },
            },
        },
    },
}

VALIDATIONS = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["rule"],
                                          "properties": {"rule": {"type": "string"}, "message": {"type": "string"}}}}
ALLOWED_ONE = {"type": "object", "additionalProperties": False,
               "properties": {"value": {"type": "string"}, "required": {"type": "boolean"}, "validations": VALIDATIONS}}
ALLOWED_MANY = {"type": "object", "additionalProperties": False,
                "properties": {"values": {"type": "array", "items": {"type": "string"}},
                               "required": {"type": "boolean"}, "validations": VALIDATIONS}}
SCHEMAS["CertificateRequestPolicy"] = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "policy.cert-manager.io/v1alpha1"}, "kind": {"const": "CertificateRequestPolicy"},
        "metadata": META,
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "issuerRef": {"type": "object", "additionalProperties": False, "properties": {
                        "name": {"type": "string"}, "kind": {"type": "string"}, "group": {"type": "string"}}},
                    "namespace": {"type": "object", "additionalProperties": False, "properties": {
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                        "matchLabels": {"type": "object"}}}}},
                "allowed": {"type": "object", "additionalProperties": False, "properties": {
                    "commonName": ALLOWED_ONE, "dnsNames": ALLOWED_MANY, "ipAddresses": ALLOWED_MANY,
                    "uris": ALLOWED_MANY, "emailAddresses": ALLOWED_MANY, "isCA": {"type": "boolean"},
                    "usages": {"type": "array", "items": {"enum": USAGES}}}},
                "constraints": {"type": "object", "additionalProperties": False, "properties": {
                    "minDuration": DURATION, "maxDuration": DURATION,
                    "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "minSize": {"type": "integer"}, "maxSize": {"type": "integer"}}}}},
            },
        },
    },
}

errors = []


def check(cond, what):
    if not cond:
        errors.append(what)


docs = []
for f in sorted(glob.glob("kubernetes/*.yaml")):
    if f.endswith("kustomization.yaml"):
        continue
    docs += [(f, d) for d in yaml.safe_load_all(open(f)) if d]
by_kind = {}
for f, d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
    if d["apiVersion"].startswith(("cert-manager.io/", "policy.cert-manager.io/")):
        try:
            jsonschema.validate(d, SCHEMAS[d["kind"]])
        except (jsonschema.ValidationError, KeyError) as e:
            errors.append(f"{f} {d['kind']}/{d['metadata']['name']}: {getattr(e, 'message', e)}")


def one(kind, name):
    found = [d for d in by_kind.get(kind, []) if d["metadata"]["name"] == name]
    check(len(found) == 1, f"expected one {kind} {name}")
    return found[0] if found else {}


def flags(args):
    out = {}
    for a in args:
        if a.startswith("--") and "=" in a:
            k, v = a[2:].split("=", 1)
            out[k] = v
    return out


issuers = {d["metadata"]["name"]: d for d in by_kind.get("Issuer", [])}
certs = {d["metadata"]["name"]: d for d in by_kind.get("Certificate", [])}
ca_secrets = {c["spec"]["secretName"] for c in certs.values() if c["spec"].get("isCA")}
for c in certs.values():
    ref = c["spec"]["issuerRef"]["name"]
    check(ref in issuers, f"Certificate {c['metadata']['name']}: no Issuer {ref}")
for i in issuers.values():
    if "ca" in i["spec"]:
        check(i["spec"]["ca"]["secretName"] in ca_secrets,
              f"Issuer {i['metadata']['name']}: its secret is no CA Certificate's")

# The server: TLS flags into its Certificate's Secret, probes on the health port.
dep = one("Deployment", "fairplace-server")
pod = dep["spec"]["template"]["spec"]
srv = pod["containers"][0]
fl = flags(srv["args"])
td = fl.get("trust-domain", "fairplace")
for k in ("tls-cert", "tls-key", "client-ca", "health-addr"):
    check(k in fl, f"server: --{k} missing")
grpc_port = int(fl.get("grpc-addr", ":50051").rsplit(":", 1)[1])
health_port = int(fl.get("health-addr", ":0").rsplit(":", 1)[1])
check(health_port != grpc_port, "server: the health-only listener must be its own port")
for probe in ("readinessProbe", "livenessProbe"):
    p = srv.get(probe, {})
    check(p.get("grpc", {}).get("port") == health_port,
          f"server {probe}: must probe the plaintext health port {health_port} (the kubelet has no client certificate)")
mounts = {m["name"]: m["mountPath"] for m in srv.get("volumeMounts", [])}
vols = {v["name"]: v for v in pod.get("volumes", [])}
server_secret = certs.get("fairplace-server", {}).get("spec", {}).get("secretName")
for k, file in (("tls-cert", "tls.crt"), ("tls-key", "tls.key"), ("client-ca", "ca.crt")):
    path = fl.get(k, "")
    ok = any(path == f"{mp}/{file}" and vols.get(n, {}).get("secret", {}).get("secretName") == server_secret
             for n, mp in mounts.items())
    check(ok, f"server --{k}={path}: not {file} of the mounted Secret {server_secret}")
check("subPath" not in str(srv.get("volumeMounts")), "server: a subPath mount never sees a renewal")
svc = one("Service", "fairplace-server")
check(any(p.get("appProtocol") != "kubernetes.io/h2c" for p in svc["spec"]["ports"] if p["name"] == "grpc"),
      "Service: the gRPC port is TLS, not h2c")

# SPIFFE IDs: the trust domain and a known role.
SPIFFE = re.compile(r"^spiffe://([a-z0-9._-]+)/(node|orchestrator|admin|server)/[A-Za-z0-9._-]+$")
for c in certs.values():
    for u in c["spec"].get("uris", []):
        m = SPIFFE.match(u)
        check(m and m.group(1) == td, f"Certificate {c['metadata']['name']}: {u} is not spiffe://{td}/ROLE/NAME")
        if m and m.group(2) != "server":
            check("client auth" in c["spec"].get("usages", []), f"Certificate {c['metadata']['name']}: needs client auth")
# Agents obey only a server whose one SPIFFE ID has the role server.
server_uris = certs.get("fairplace-server", {}).get("spec", {}).get("uris", [])
check(server_uris == [f"spiffe://{td}/server/fairplace-server"],
      f"server Certificate: needs exactly the URI SAN spiffe://{td}/server/fairplace-server, has {server_uris}")
check("server auth" in certs.get("fairplace-server", {}).get("spec", {}).get("usages", []),
      "server Certificate: needs server auth")

# The agents: a csi-driver certificate from the CA issuer, completed by the policy.
ds = one("DaemonSet", "fairplace-agent")
apod = ds["spec"]["template"]["spec"]
agent = apod["containers"][0]
script = " ".join(agent.get("args", []) + agent.get("command", []))
avols = {v["name"]: v for v in apod.get("volumes", [])}
tlsvol = avols.get("agent-tls", {}).get("csi", {})
attrs = tlsvol.get("volumeAttributes", {})
check(tlsvol.get("driver") == "csi.cert-manager.io", "agent: the agent-tls volume must be cert-manager's csi-driver")
check(attrs.get("csi.cert-manager.io/issuer-name") in issuers, "agent: the csi volume's issuer is not defined here")
check(attrs.get("csi.cert-manager.io/uri-sans", "").startswith(f"spiffe://{td}/node/"),
      f"agent: the csi volume's URI SAN must be spiffe://{td}/node/...")
check("client auth" in attrs.get("csi.cert-manager.io/key-usages", ""), "agent: the certificate needs client auth")
amount = {m["name"]: m["mountPath"] for m in agent.get("volumeMounts", [])}.get("agent-tls")
for flag, attr in (("--tls-cert", "certificate-file"), ("--tls-key", "privatekey-file"), ("--tls-ca", "ca-file")):
    want = f"{flag} {amount}/{attrs.get('csi.cert-manager.io/' + attr)}"
    check(want in script, f"agent: expected `{want}`")
pol = one("MutatingAdmissionPolicy", "fairplace-agent-node-identity")
expr = pol.get("spec", {}).get("mutations", [{}])[0].get("applyConfiguration", {}).get("expression", "")
check('name: "agent-tls"' in expr and f'"spiffe://{td}/node/" + variables.node' in expr,
      "policy: must fill the agent-tls volume's URI SAN with the node")
bind = one("MutatingAdmissionPolicyBinding", "fairplace-agent-node-identity")
check(bind.get("spec", {}).get("policyName") == "fairplace-agent-node-identity", "policy binding: wrong policy")

# approver-policy: every identity issued here is permitted by a policy its
# requester may use, and what a pod could forge is denied. The evaluation
# follows approver-policy's: a policy is appropriate when its selector
# matches the request's issuer and namespace and the requester may `use`
# it; the request is approved when an appropriate policy permits it (every
# requested value within `allowed`, wildcards '*', required fields present,
# the constraints met); with no appropriate policy it is never approved.
def hours(d):
    total = 0.0
    for n, unit in re.findall(r"([0-9.]+)(h|m|s)", d or "0h"):
        total += float(n) * {"h": 1, "m": 1 / 60, "s": 1 / 3600}[unit]
    return total


def wild(pattern, value):
    return fnmatch.fnmatchcase(value, pattern)


def field_ok(allowed, values, many=True):
    values = [v for v in values if v]
    if not allowed:
        return not values
    if allowed.get("required") and not values:
        return False
    pats = allowed.get("values", []) if many else [allowed.get("value", "")]
    if not all(any(wild(p, v) for p in pats) for v in values):
        return False
    # The CEL validations used here are all self.matches('^...$').
    for rule in allowed.get("validations", []):
        m = re.fullmatch(r"self\.matches\('(.*)'\)", rule["rule"])
        check(m, f"approver-policy: cannot model the rule {rule['rule']}")
        if m and not all(re.search(m.group(1), v) for v in values):
            return False
    return True


def permits(p, req):
    a, c = p["spec"].get("allowed", {}), p["spec"].get("constraints", {})
    return (field_ok(a.get("commonName"), [req.get("cn", "")], many=False)
            and field_ok(a.get("dnsNames"), req.get("dns", []))
            and field_ok(a.get("uris"), req.get("uris", []))
            and field_ok(a.get("ipAddresses"), req.get("ips", []))
            and set(req.get("usages", [])) <= set(a.get("usages", []))
            and (not req.get("isCA") or a.get("isCA", False))
            and ("maxDuration" not in c or hours(req.get("duration")) <= hours(c["maxDuration"]))
            and c.get("privateKey", {}).get("algorithm", req.get("algo")) == req.get("algo"))


roles = {d["metadata"]["name"]: d for d in by_kind.get("Role", [])}
usable = {}
for b in by_kind.get("RoleBinding", []):
    role = roles.get(b["roleRef"]["name"], {})
    names = [n for r in role.get("rules", []) if "certificaterequestpolicies" in r.get("resources", [])
             and "use" in r.get("verbs", []) for n in r.get("resourceNames", [])]
    for sub in b.get("subjects", []):
        usable.setdefault(f"{sub['namespace']}/{sub['name']}", set()).update(names)
policies = {d["metadata"]["name"]: d for d in by_kind.get("CertificateRequestPolicy", [])}
for who, names in usable.items():
    for n in names:
        check(n in policies, f"approver-policy: {who} may use {n}, which is not defined")
CONTROLLER, CSI = "cert-manager/cert-manager", "cert-manager/cert-manager-csi-driver"


def approved(requester, req):
    sel = [p for n, p in policies.items() if n in usable.get(requester, set())
           and all(wild(p["spec"]["selector"].get("issuerRef", {}).get(k, "*"), req["issuer"][k])
                   for k in ("name", "kind", "group"))
           and any(wild(m, "fairplace") for m in
                   p["spec"]["selector"].get("namespace", {}).get("matchNames", ["*"]))]
    return any(permits(p, req) for p in sel)


def cert_request(c):
    sp = c["spec"]
    usages = sp.get("usages") or ["digital signature", "key encipherment"]
    if sp.get("isCA") and "cert sign" not in usages:
        usages = usages + ["cert sign"]
    ref = {"kind": "Issuer", "group": "cert-manager.io", **sp["issuerRef"]}
    return {"cn": sp.get("commonName", ""), "dns": sp.get("dnsNames", []), "uris": sp.get("uris", []),
            "ips": sp.get("ipAddresses", []), "usages": usages, "isCA": sp.get("isCA", False),
            "duration": sp.get("duration", "2160h"), "algo": sp.get("privateKey", {}).get("algorithm", "RSA"),
            "issuer": ref}


for c in certs.values():
    check(approved(CONTROLLER, cert_request(c)),
          f"approver-policy: Certificate {c['metadata']['name']} would not be approved")
node_req = {"cn": "", "uris": [f"spiffe://{td}/node/worker-1"],
            "usages": [u.strip() for u in attrs.get("csi.cert-manager.io/key-usages", "").split(",")],
            "duration": attrs.get("csi.cert-manager.io/duration"),
            "algo": attrs.get("csi.cert-manager.io/key-algorithm"),
            "issuer": {"name": attrs.get("csi.cert-manager.io/issuer-name"),
                       "kind": attrs.get("csi.cert-manager.io/issuer-kind"),
                       "group": attrs.get("csi.cert-manager.io/issuer-group")}}
check(approved(CSI, node_req), "approver-policy: the agents' csi certificates would not be approved")
forged = {
    "an admin URI": {"uris": [f"spiffe://{td}/admin/operator"]},
    "the server's URI": {"uris": [f"spiffe://{td}/server/fairplace-server"]},
    "an orchestrator URI": {"uris": [f"spiffe://{td}/orchestrator/default"]},
    "a node URI with a path": {"uris": [f"spiffe://{td}/node/a/b"]},
    "a node URI plus a DNS name": {"dns": ["fairplace-server"]},
    "server auth": {"usages": ["server auth", "digital signature"]},
    "a CA": {"isCA": True},
    "a week": {"duration": "168h"},
    "no URI": {"uris": []},
}
for what, change in forged.items():
    check(not approved(CSI, {**node_req, **change}), f"approver-policy: a csi volume asking for {what} is approved")
    check(not approved("fairplace/default", {**node_req, **change}),
          f"approver-policy: a pod's own service account may use a policy ({what})")
ctl_forged = {"an admin of another name": {"cn": "admin/mallory", "uris": [f"spiffe://{td}/admin/mallory"]},
              "a node identity": {"cn": "", "uris": [f"spiffe://{td}/node/worker-1"]}}
admin_req = cert_request(certs.get("fairplace-admin", {"spec": {"issuerRef": {"name": "fairplace-ca"}}}))
for what, change in ctl_forged.items():
    check(not approved(CONTROLLER, {**admin_req, **change}), f"approver-policy: a Certificate for {what} is approved")
vap = one("ValidatingAdmissionPolicy", "fairplace-agent-node-identity-guard")
vexprs = " ".join(v["expression"] for v in vap.get("spec", {}).get("validations", []))
check("daemon-set-controller" in vexprs and "'fairplace-agent'" in vexprs and
      f"'spiffe://{td}/node/' + variables.node" in vexprs,
      "admission: only the DaemonSet controller's fairplace-agent pods may name their own node")
vbind = one("ValidatingAdmissionPolicyBinding", "fairplace-agent-node-identity-guard")
check(vbind.get("spec", {}).get("validationActions") == ["Deny"], "admission: the guard must deny")

# The agent applies through the host's pid namespace and cgroup tree.
check(apod.get("hostPID") is True, "agent: hostPID is needed (a lease's pid is the host's)")
check("--proc-root" not in script or "--proc-root /proc " in script,
      "agent: with hostPID it reads its own /proc (another --proc-root turns applying off)")
m = re.search(r"--cgroup-root (\S+)", script)
cg_mount = {mm["name"]: mm for mm in agent.get("volumeMounts", [])}
cg_vol = [n for n, mm in cg_mount.items() if m and mm["mountPath"] == m.group(1)]
check(cg_vol and avols.get(cg_vol[0], {}).get("hostPath", {}).get("path") == "/sys/fs/cgroup"
      and not cg_mount[cg_vol[0]].get("readOnly", False),
      "agent: --cgroup-root must be the host's /sys/fs/cgroup, mounted writable")
caps = agent.get("securityContext", {}).get("capabilities", {})
check(caps.get("drop") == ["ALL"] and "SYS_NICE" in caps.get("add", []),
      "agent: every capability dropped but the ones used; SYS_NICE pins other users' processes")

# Compose: mutual TLS on by default too.
comp = yaml.safe_load(open("compose.yaml"))
scmd = " ".join(comp["services"]["server"]["command"])
check("--client-ca" in scmd and "--tls-cert" in scmd, "compose: the server must serve mutual TLS")
acmd = " ".join(comp["services"]["agent"]["command"])
check("--tls-cert" in acmd and "--tls-ca" in acmd, "compose: the agent must present its node certificate")
check("--tls-cert" in " ".join(comp["services"]["server"]["healthcheck"]["test"]),
      "compose: the healthcheck must use a client certificate")

if errors:
    print("\n".join("FAIL " + e for e in errors))
    sys.exit(1)
print(f"mutual TLS wiring OK: {len(certs)} Certificates, {len(issuers)} Issuers, trust domain {td}, "
      f"probes on :{health_port}")
