"""Static checks of the mutual-TLS deployment (run by check.sh, from deploy/).

cert-manager's Issuer and Certificate are validated against the subset of
their v1 CRD schemas these manifests use (unknown fields fail), and the
manifests are checked against each other: the server's TLS flags point into
the mounted Secret of its Certificate, the probes use the plaintext
health-only port, the agents' csi-driver volume asks the CA issuer for a
node identity that the admission policy completes, and every SPIFFE ID is
in the server's trust domain with a known role.
"""
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
    if d["apiVersion"].startswith("cert-manager.io/"):
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
