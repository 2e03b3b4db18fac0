"""Static checks of the mutual-TLS deployment (run by check.sh, from deploy/).

cert-manager's Issuer and Certificate are validated against the subset of
their v1 CRD schemas these manifests use (unknown fields fail), and the
manifests are checked against each other: each server replica's TLS flags
(--tls-*, --client-ca, --replica-tls-*, --etcd-tls-*) point into its mounted
csi-driver volumes, its serving certificate names the address it advertises
and the Services, its replica certificate is spiffe://TD/replica/POD from
the CA the other replicas trust; etcd runs mutual TLS on both ports with a
CA of its own, its members' certificate names every member of its static
--initial-cluster, and the replicas name every member; etcd's flags are
etcd 3.4's (Dockerfile.etcd, Debian's etcd) in both setups; the probes use the
plaintext health-only port (etcd's metrics port: /health for readiness,
/metrics for startup and liveness, as etcd 3.4's /health needs a quorum); the
agents' csi-driver volume asks the CA issuer for a node identity that the
admission policy completes; approver-policy approves exactly what is issued
here (its evaluation modelled, forged requests denied); the compose replicas
are wired alike; and every SPIFFE ID is in the server's trust domain with a
known role.
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


# The etcd image (Dockerfile.etcd) is Debian's etcd 3.4: every flag the
# manifests give it must be one of etcd 3.4's (`etcd --help` of 3.4.23).
# 3.5's own (e.g. --experimental-* ones it added, --log-format) would stop
# etcd 3.4 at start.
ETCD34_FLAGS = set("""
name data-dir wal-dir snapshot-count heartbeat-interval election-timeout initial-election-tick-advance
listen-peer-urls listen-client-urls max-snapshots max-wals quota-backend-bytes backend-batch-interval
backend-batch-limit max-txn-ops max-request-bytes max-concurrent-streams grpc-keepalive-min-time
grpc-keepalive-interval grpc-keepalive-timeout initial-advertise-peer-urls initial-cluster
initial-cluster-state initial-cluster-token advertise-client-urls discovery discovery-fallback
discovery-proxy discovery-srv discovery-srv-name strict-reconfig-check pre-vote auto-compaction-retention
auto-compaction-mode enable-v2 cert-file key-file client-cert-auth client-crl-file
client-cert-allowed-hostname trusted-ca-file auto-tls peer-cert-file peer-key-file peer-client-cert-auth
peer-trusted-ca-file peer-cert-allowed-cn peer-cert-allowed-hostname peer-auto-tls peer-crl-file
cipher-suites cors host-whitelist auth-token bcrypt-cost auth-token-ttl enable-pprof metrics
listen-metrics-urls logger log-outputs log-level proxy proxy-failure-wait proxy-refresh-interval
proxy-dial-timeout proxy-write-timeout proxy-read-timeout experimental-initial-corrupt-check
experimental-corrupt-check-time experimental-enable-v2v3 experimental-backend-bbolt-freelist-type
experimental-enable-lease-checkpoint experimental-compaction-batch-limit
experimental-peer-skip-client-san-verification experimental-watch-progress-notify-interval
experimental-warning-apply-duration force-new-cluster debug log-package-levels
""".split())
ETCD_IMAGE = "fairplace-etcd:latest"
# The user Dockerfile.etcd runs etcd as (USER uid:gid).
ETCD_USER = next((ln.split()[1] for ln in open("Dockerfile.etcd") if ln.startswith("USER ")), "")


def etcd34(where, args):
    """etcd 3.4 takes these flags, with 3.5's defaults where they differ."""
    for a in args:
        check(a.startswith("--") and a[2:].split("=", 1)[0] in ETCD34_FLAGS,
              f"{where}: {a.split('=', 1)[0]} is not a flag of etcd 3.4 (Dockerfile.etcd's)")
    f = flags(args)
    check(f.get("pre-vote") == "true", f"{where}: --pre-vote=true (3.5's default, off in 3.4)")
    check(f.get("logger") == "zap", f"{where}: --logger=zap (3.5's default; 3.4's capnslog is deprecated)")


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

# The server: a StatefulSet of replicas on etcd. Each pod's TLS flags point
# into its mounted csi-driver volumes, probes use the health port.
NS = "fairplace"  # kustomization.yaml's namespace, what $(POD_NAMESPACE) is
sts = one("StatefulSet", "fairplace-server")
pod = sts.get("spec", {}).get("template", {}).get("spec", {})
srv = (pod.get("containers") or [{}])[0]
fl = flags(srv.get("args", []))
td = fl.get("trust-domain", "fairplace")
check(not by_kind.get("Deployment"), "server: a Deployment besides the StatefulSet would be a second replica set")
check(sts.get("spec", {}).get("replicas", 1) >= 3, "server: three replicas (two stay up through a disruption)")
for k in ("tls-cert", "tls-key", "client-ca", "health-addr"):
    check(k in fl, f"server: --{k} missing")
grpc_port = int(fl.get("grpc-addr", ":50051").rsplit(":", 1)[1])
health_port = int(fl.get("health-addr", ":0").rsplit(":", 1)[1])
check(health_port != grpc_port, "server: the health-only listener must be its own port")
for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
    p = srv.get(probe, {})
    check(p.get("grpc", {}).get("port") == health_port,
          f"server {probe}: must probe the plaintext health port {health_port} (the kubelet has no client certificate)")
mounts = {m["name"]: m["mountPath"] for m in srv.get("volumeMounts", [])}
vols = {v["name"]: v for v in pod.get("volumes", [])}
env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in srv.get("env", [])}
check(env.get("POD_NAME") == "metadata.name" and env.get("POD_NAMESPACE") == "metadata.namespace",
      "server: POD_NAME and POD_NAMESPACE from the downward API (metadata.name, metadata.namespace)")
check("subPath" not in str(srv.get("volumeMounts")), "server: a subPath mount never sees a renewal")


def csi_file(flag, attr, what):
    """The csi-driver volume whose file `attr` (certificate-file, ...) the
    server's --flag names; checks it is mounted and is cert-manager's."""
    path = fl.get(flag, "")
    for n, mp in mounts.items():
        a = vols.get(n, {}).get("csi", {}).get("volumeAttributes", {})
        if vols.get(n, {}).get("csi", {}).get("driver") == "csi.cert-manager.io" and \
                path == f"{mp}/{a.get('csi.cert-manager.io/' + attr)}":
            return n, a
    check(False, f"server --{flag}={path}: not the {attr} of a mounted csi.cert-manager.io volume ({what})")
    return None, {}


def issued_by_ca_of(attrs):
    """The Issuer a csi volume asks, if it is a CA issuer defined here."""
    i = issuers.get(attrs.get("csi.cert-manager.io/issuer-name"), {})
    check(attrs.get("csi.cert-manager.io/issuer-kind", "Issuer") == "Issuer" and "ca" in i.get("spec", {}),
          f"csi volume: issuer {attrs.get('csi.cert-manager.io/issuer-name')} is not a CA Issuer defined here")
    return i.get("spec", {}).get("ca", {}).get("secretName")


def expand(s, pod_name="fairplace-server-1"):
    """A csi attribute or an arg as the driver or the kubelet fills it in."""
    for k, v in (("${POD_NAME}", pod_name), ("$(POD_NAME)", pod_name),
                 ("${POD_NAMESPACE}", NS), ("$(POD_NAMESPACE)", NS)):
        s = s.replace(k, v)
    return s


# The serving certificate, and the CA callers (and peers) must chain to.
srv_vol, srv_attrs = csi_file("tls-cert", "certificate-file", "the serving certificate")
for flag, attr in (("tls-key", "privatekey-file"), ("client-ca", "ca-file")):
    check(csi_file(flag, attr, "the serving certificate")[0] == srv_vol,
          f"server --{flag}: not the {attr} of the serving certificate's volume {srv_vol}")
fairplace_ca = issued_by_ca_of(srv_attrs)
# Agents obey only a server whose one SPIFFE ID has the role server.
check(srv_attrs.get("csi.cert-manager.io/uri-sans") == f"spiffe://{td}/server/fairplace-server",
      f"server certificate: needs exactly the URI SAN spiffe://{td}/server/fairplace-server, "
      f"has {srv_attrs.get('csi.cert-manager.io/uri-sans')}")
check("server auth" in srv_attrs.get("csi.cert-manager.io/key-usages", ""), "server certificate: needs server auth")
srv_dns = [d.strip() for d in srv_attrs.get("csi.cert-manager.io/dns-names", "").split(",")]
# Each pod advertises its own stable name, which its certificate must name.
peers_name = sts.get("spec", {}).get("serviceName", "")
want_adv = f"$(POD_NAME).{peers_name}.$(POD_NAMESPACE).svc:{grpc_port}"
check(fl.get("advertise-addr") == want_adv, f"server: --advertise-addr must be {want_adv}, the pod's stable name")
check(fl.get("replica-id") == "$(POD_NAME)", "server: --replica-id=$(POD_NAME), the name its peer certificate has")
adv_host = fl.get("advertise-addr", "").rsplit(":", 1)[0].replace("$(", "${").replace(")", "}")
check(adv_host in srv_dns, f"server certificate: does not name the advertised host {adv_host} ({srv_dns})")
peers = one("Service", peers_name) if peers_name else {}
check(peers.get("spec", {}).get("clusterIP") == "None" and peers.get("spec", {}).get("publishNotReadyAddresses"),
      f"Service {peers_name}: headless, with publishNotReadyAddresses (a replica is named as owner before it is ready)")
check(any(p.get("port") == grpc_port for p in peers.get("spec", {}).get("ports", [])),
      f"Service {peers_name}: must serve the gRPC port {grpc_port}")
svc = one("Service", "fairplace-server")
check(svc.get("spec", {}).get("clusterIP") != "None", "Service fairplace-server: one address for agents and callers")
check(any(p.get("appProtocol") != "kubernetes.io/h2c" for p in svc.get("spec", {}).get("ports", []) if p["name"] == "grpc"),
      "Service: the gRPC port is TLS, not h2c")
for name in ("fairplace-server", "fairplace-server.${POD_NAMESPACE}", "fairplace-server.${POD_NAMESPACE}.svc"):
    check(name in srv_dns, f"server certificate: does not name the Service as {name}")
check(not any(v.get("persistentVolumeClaim") for v in vols.values()) and
      not sts.get("spec", {}).get("volumeClaimTemplates") and "state-dir" not in fl,
      "server: leases are in etcd; no --state-dir, no PersistentVolumeClaim")

# The replica's peer certificate: the replica role, its own pod, client auth,
# from the CA the other replicas' --client-ca trusts.
rep_vol, rep_attrs = csi_file("replica-tls-cert", "certificate-file", "the replica certificate")
check(csi_file("replica-tls-key", "privatekey-file", "the replica certificate")[0] == rep_vol,
      "server --replica-tls-key: not the key of the --replica-tls-cert volume")
check(rep_attrs.get("csi.cert-manager.io/uri-sans") == f"spiffe://{td}/replica/${{POD_NAME}}",
      f"replica certificate: needs exactly spiffe://{td}/replica/${{POD_NAME}} (--replica-id is the pod name)")
check(rep_attrs.get("csi.cert-manager.io/key-usages") == "client auth,digital signature"
      and "csi.cert-manager.io/common-name" not in rep_attrs,
      "replica certificate: client auth only, no common name")
check(issued_by_ca_of(rep_attrs) == fairplace_ca, "replica certificate: must come from the CA --client-ca trusts")
check(fl.get("peer-ca", fl.get("client-ca")) == fl.get("client-ca"),
      "server --peer-ca: the other replicas' serving certificates chain to the --client-ca CA")

# etcd: the members the server names, their certificate, their CA (not
# fairplace's: etcd's --client-cert-auth lets in anything its CA signed).
ests = one("StatefulSet", "fairplace-etcd")
epod = ests.get("spec", {}).get("template", {}).get("spec", {})
etcd = (epod.get("containers") or [{}])[0]
eargs = etcd.get("args", []) + etcd.get("command", [])[1:]
etcd34("etcd", eargs)
efl = flags(eargs)
emounts = {m["name"]: m["mountPath"] for m in etcd.get("volumeMounts", [])}
evols = {v["name"]: v for v in epod.get("volumes", [])}
ecert = certs.get("fairplace-etcd", {})
esecret = ecert.get("spec", {}).get("secretName")
check(etcd.get("image") == ETCD_IMAGE and etcd.get("imagePullPolicy") == "IfNotPresent"
      and "command" not in etcd,
      f"etcd: the image {ETCD_IMAGE} (Dockerfile.etcd, loaded into the cluster: IfNotPresent; its "
      f"entrypoint is etcd), not {etcd.get('image')}")
kust = yaml.safe_load(open("kubernetes/kustomization.yaml"))
check(any(i.get("name") == ETCD_IMAGE.split(":")[0] and i.get("newTag") == ETCD_IMAGE.split(":")[1]
          for i in kust.get("images", [])), f"kustomization.yaml: images must list {ETCD_IMAGE}")
check(ests.get("spec", {}).get("replicas") == 3, "etcd: three members (a quorum survives one lost)")
for k, file in (("trusted-ca-file", "ca.crt"), ("cert-file", "tls.crt"), ("key-file", "tls.key"),
                ("peer-trusted-ca-file", "ca.crt"), ("peer-cert-file", "tls.crt"), ("peer-key-file", "tls.key")):
    ok = any(efl.get(k) == f"{mp}/{file}" and evols.get(n, {}).get("secret", {}).get("secretName") == esecret
             for n, mp in emounts.items())
    check(ok, f"etcd --{k}={efl.get(k)}: not {file} of the mounted Secret {esecret}")
for b in ("--client-cert-auth", "--peer-client-cert-auth"):
    check(b in eargs or efl.get(b[2:]) == "true", f"etcd: {b} (mutual TLS)")
for b in ("auto-tls", "peer-auto-tls"):
    check(f"--{b}" not in eargs and efl.get(b, "false") == "false", f"etcd: --{b} would make its own certificates")
check(efl.get("peer-cert-allowed-cn") == ecert.get("spec", {}).get("commonName"),
      "etcd: --peer-cert-allowed-cn must be the members' common name (client certificates have none)")
for k in ("listen-client-urls", "listen-peer-urls", "advertise-client-urls", "initial-advertise-peer-urls"):
    check(efl.get(k, "").startswith("https://"), f"etcd --{k}: https")
check(not ecert.get("spec", {}).get("uris") and "client auth" in ecert.get("spec", {}).get("usages", [])
      and "server auth" in ecert.get("spec", {}).get("usages", []),
      "etcd members' certificate: no fairplace identity; server auth (clients, peers) and client auth (to peers)")
esvc_name = ests.get("spec", {}).get("serviceName", "")
esvc = one("Service", esvc_name) if esvc_name else {}
check(esvc.get("spec", {}).get("clusterIP") == "None" and esvc.get("spec", {}).get("publishNotReadyAddresses"),
      f"Service {esvc_name}: headless with publishNotReadyAddresses (members find each other before a quorum)")
members = [f"fairplace-etcd-{i}" for i in range(ests.get("spec", {}).get("replicas", 0))]
peer_port = int(efl.get("listen-peer-urls", ":2380").rsplit(":", 1)[1])
client_port = int(efl.get("listen-client-urls", ":2379").rsplit(":", 1)[1])
want_ic = ",".join(f"{m}=https://{m}.{esvc_name}.$(POD_NAMESPACE).svc:{peer_port}" for m in members)
check(efl.get("initial-cluster") == want_ic, f"etcd --initial-cluster: expected {want_ic}")
check(efl.get("initial-advertise-peer-urls") == f"https://$(POD_NAME).{esvc_name}.$(POD_NAMESPACE).svc:{peer_port}"
      and efl.get("advertise-client-urls") == f"https://$(POD_NAME).{esvc_name}.$(POD_NAMESPACE).svc:{client_port}"
      and efl.get("name") == "$(POD_NAME)", "etcd: --name and its advertised URLs are the pod's stable name")
for m in members:
    check(f"{m}.{esvc_name}.{NS}.svc" in ecert.get("spec", {}).get("dnsNames", []),
          f"etcd members' certificate: does not name {m}.{esvc_name}.{NS}.svc")
metrics_port = {p["name"]: p["containerPort"] for p in etcd.get("ports", [])}.get("metrics")
check(efl.get("listen-metrics-urls") == f"http://0.0.0.0:{metrics_port}",
      "etcd: --listen-metrics-urls on the metrics port (plain HTTP, /health and /metrics for the probes)")
# etcd 3.4's /health (its only health path: no /livez, /readyz) needs a
# leader and no alarm, and ignores 3.5's ?serializable and ?exclude. It is
# readiness; /metrics answers without a quorum, for startup and liveness (a
# lost quorum is no reason to restart a member).
for probe, path in (("startupProbe", "/metrics"), ("readinessProbe", "/health"), ("livenessProbe", "/metrics")):
    g = etcd.get(probe, {}).get("httpGet", {})
    check(g.get("path") == path and g.get("port") in ("metrics", metrics_port),
          f"etcd {probe}: {path} on the metrics port (etcd 3.4), not {g.get('path')}")
esc = {**epod.get("securityContext", {}), **etcd.get("securityContext", {})}
check(esc.get("runAsNonRoot") and esc.get("readOnlyRootFilesystem") and not esc.get("allowPrivilegeEscalation", True)
      and esc.get("capabilities", {}).get("drop") == ["ALL"], "etcd: non-root, read-only root, no capability")
check(ETCD_USER and f"{esc.get('runAsUser')}:{esc.get('runAsGroup')}" == ETCD_USER
      and str(epod.get("securityContext", {}).get("fsGroup")) == ETCD_USER.split(":")[1],
      f"etcd: runAsUser, runAsGroup and fsGroup must be Dockerfile.etcd's user {ETCD_USER}")
check(any(emounts.get(t["metadata"]["name"]) and efl.get("data-dir", "").startswith(emounts[t["metadata"]["name"]] + "/")
          for t in ests.get("spec", {}).get("volumeClaimTemplates", [])),
      "etcd: --data-dir beneath a volumeClaimTemplates volume")
# The server's etcd flags: every member over https, the client certificate
# and CA from etcd's own CA issuer, the same one that signed the members.
eps = fl.get("etcd-endpoints", "").split(",")
want_eps = [f"https://{m}.{esvc_name}.$(POD_NAMESPACE).svc:{client_port}" for m in members]
check(eps == want_eps, f"server --etcd-endpoints: expected {','.join(want_eps)}")
etls_vol, etls_attrs = csi_file("etcd-tls-cert", "certificate-file", "the etcd client certificate")
for flag, attr in (("etcd-tls-key", "privatekey-file"), ("etcd-tls-ca", "ca-file")):
    check(csi_file(flag, attr, "the etcd client certificate")[0] == etls_vol,
          f"server --{flag}: not the {attr} of the etcd client certificate's volume {etls_vol}")
etcd_ca = issued_by_ca_of(etls_attrs)
check(etls_attrs.get("csi.cert-manager.io/issuer-name") == ecert.get("spec", {}).get("issuerRef", {}).get("name"),
      "server: its etcd client certificate and the etcd members' certificate must come from the same issuer")
check(etcd_ca and etcd_ca != fairplace_ca,
      "etcd: a CA of its own (with the fairplace CA any agent's certificate would pass --client-cert-auth)")
check(etls_attrs.get("csi.cert-manager.io/key-usages") == "client auth,digital signature"
      and etls_attrs.get("csi.cert-manager.io/uri-sans") == f"spiffe://{td}/replica/${{POD_NAME}}"
      and "csi.cert-manager.io/common-name" not in etls_attrs,
      "etcd client certificate: the replica's identity, client auth only, no common name")

# SPIFFE IDs: the trust domain and a known role.
SPIFFE = re.compile(r"^spiffe://([a-z0-9._-]+)/(node|orchestrator|admin|server|replica)/[A-Za-z0-9._${}-]+$")
sources = [(f"Certificate {c['metadata']['name']}", c["spec"].get("uris", []), c["spec"].get("usages", []))
           for c in certs.values()]
sources += [(f"server volume {n}", v["csi"]["volumeAttributes"].get("csi.cert-manager.io/uri-sans", "").split(","),
             v["csi"]["volumeAttributes"].get("csi.cert-manager.io/key-usages", "").split(","))
            for n, v in vols.items() if "csi" in v]
for what, uris, usages in sources:
    for u in filter(None, uris):
        m = SPIFFE.match(u)
        check(m and m.group(1) == td, f"{what}: {u} is not spiffe://{td}/ROLE/NAME")
        if m and m.group(2) != "server":
            check("client auth" in usages, f"{what}: needs client auth")

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


def csi_request(a, pod="fairplace-server-1"):
    """The CertificateRequest the csi-driver makes for a volume of `pod`."""
    def get(k):
        return expand(a.get("csi.cert-manager.io/" + k, ""), pod)

    def split(s):
        return [x.strip() for x in s.split(",") if x.strip()]
    return {"cn": get("common-name"), "dns": split(get("dns-names")), "uris": split(get("uri-sans")),
            "ips": split(get("ip-sans")), "usages": split(get("key-usages")), "isCA": get("is-ca") == "true",
            "duration": get("duration"), "algo": get("key-algorithm"),
            "issuer": {"name": get("issuer-name"), "kind": get("issuer-kind") or "Issuer",
                       "group": get("issuer-group") or "cert-manager.io"}}


# The server pods' three csi certificates, for each replica.
for n, v in vols.items():
    if v.get("csi", {}).get("driver") == "csi.cert-manager.io":
        for i in range(sts.get("spec", {}).get("replicas", 0)):
            check(approved(CSI, csi_request(v["csi"]["volumeAttributes"], f"fairplace-server-{i}")),
                  f"approver-policy: the server pod's {n} certificate would not be approved (fairplace-server-{i})")
server_req, rep_req, etcd_req = csi_request(srv_attrs), csi_request(rep_attrs), csi_request(etls_attrs)
member_req = cert_request(ecert) if ecert else {}
csi_forged = {
    "the server's URI with a foreign DNS name": {**server_req, "dns": server_req["dns"] + ["example.com"]},
    "the server's URI naming another namespace's Service": {
        **server_req, "dns": ["fairplace-server.elsewhere.svc"]},
    "the server's URI naming a pod of another StatefulSet": {
        **server_req, "dns": ["web-0.fairplace-server-peers.fairplace.svc"]},
    "the server's URI with client auth": {**server_req, "usages": server_req["usages"] + ["client auth"]},
    "the server's URI for two days": {**server_req, "duration": "48h"},
    "the server's DNS names with an admin URI": {**server_req, "uris": [f"spiffe://{td}/admin/operator"]},
    "the server's DNS names without a URI": {**server_req, "uris": []},
    "the server's URI with an IP address": {**server_req, "ips": ["10.0.0.1"]},
    "the server's URI with a common name": {**server_req, "cn": "fairplace-server"},
    "the server's URI as a CA": {**server_req, "isCA": True},
    "the server's URI from etcd's CA": {**server_req, "issuer": etcd_req["issuer"]},
    "a replica of another name": {**rep_req, "uris": [f"spiffe://{td}/replica/mallory"]},
    "a replica URI with a path": {**rep_req, "uris": [f"spiffe://{td}/replica/fairplace-server-1/x"]},
    "a replica URI with server auth": {**rep_req, "usages": ["server auth", "digital signature"]},
    "a replica URI with a DNS name": {**rep_req, "dns": ["fairplace-server"]},
    "a replica URI for a year": {**rep_req, "duration": "8760h"},
    "an etcd member's certificate": {**member_req, "issuer": etcd_req["issuer"]},
    "a node URI from etcd's CA": {**etcd_req, "uris": [f"spiffe://{td}/node/worker-1"]},
    "an etcd client certificate without a URI": {**etcd_req, "uris": []},
    "an etcd client certificate with a common name": {**etcd_req, "cn": "root"},
}
for what, req in csi_forged.items():
    check(not approved(CSI, req), f"approver-policy: a csi volume asking for {what} is approved")
    check(not approved("fairplace/default", req), f"approver-policy: a pod's own service account may use a policy ({what})")
ctl_forged = {"an admin of another name": {"cn": "admin/mallory", "uris": [f"spiffe://{td}/admin/mallory"]},
              "a node identity": {"cn": "", "uris": [f"spiffe://{td}/node/worker-1"]},
              "a replica identity": {"cn": "", "uris": [f"spiffe://{td}/replica/fairplace-server-1"]}}
admin_req = cert_request(certs.get("fairplace-admin", {"spec": {"issuerRef": {"name": "fairplace-ca"}}}))
for what, change in ctl_forged.items():
    check(not approved(CONTROLLER, {**admin_req, **change}), f"approver-policy: a Certificate for {what} is approved")
for what, req in {"the server's identity (csi volumes only now)": server_req,
                  "an etcd client certificate (csi volumes only)": etcd_req,
                  "an etcd member's name with a fairplace URI": {**member_req, "uris": [f"spiffe://{td}/admin/x"]},
                  "an etcd member's certificate from the fairplace CA": {**member_req, "issuer": server_req["issuer"]},
                  "an etcd member's certificate for another name": {**member_req, "dns": ["example.com"]}}.items():
    check(not approved(CONTROLLER, req), f"approver-policy: a Certificate for {what} is approved")

# Admission: the agents' guard and the server pods' guard split the pods
# that mount the csi-driver between them (by a StatefulSet controller owner,
# which the server guard checks came from the StatefulSet controller).
vap = one("ValidatingAdmissionPolicy", "fairplace-agent-node-identity-guard")
vexprs = " ".join(v["expression"] for v in vap.get("spec", {}).get("validations", []))
check("daemon-set-controller" in vexprs and "'fairplace-agent'" in vexprs and
      f"'spiffe://{td}/node/' + variables.node" in vexprs,
      "admission: only the DaemonSet controller's fairplace-agent pods may name their own node")
svap = one("ValidatingAdmissionPolicy", "fairplace-server-identity-guard")
sexprs = " ".join(v["expression"] for v in svap.get("spec", {}).get("validations", []))
svars = {v["name"]: v["expression"] for v in svap.get("spec", {}).get("variables", [])}
check("statefulset-controller" in sexprs and "'fairplace-server'" in sexprs and
      f"'spiffe://{td}/replica/${{POD_NAME}}'" in sexprs and f"'spiffe://{td}/server/fairplace-server'" in sexprs,
      "admission: only the StatefulSet controller's fairplace-server pods may mount the server's and replicas' identities")
check(svars.get("serverDnsNames", "").strip() == "'" + srv_attrs.get("csi.cert-manager.io/dns-names", "") + "'",
      "admission: the server guard's DNS names must be the StatefulSet's, exactly")
amc = " ".join(c["expression"] for c in vap.get("spec", {}).get("matchConditions", []))
smc = " ".join(c["expression"] for c in svap.get("spec", {}).get("matchConditions", []))
check("!object.metadata.ownerReferences.exists" in amc and "'StatefulSet'" in amc and "'StatefulSet'" in smc
      and "csi.cert-manager.io" in smc, "admission: the two guards must split the csi pods by StatefulSet owner")
for b in ("fairplace-agent-node-identity-guard", "fairplace-server-identity-guard"):
    vbind = one("ValidatingAdmissionPolicyBinding", b)
    check(vbind.get("spec", {}).get("validationActions") == ["Deny"] and vbind.get("spec", {}).get("policyName") == b,
          f"admission: the guard {b} must deny")

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

# Compose: mutual TLS on by default too, three replicas on three etcd members.
comp = yaml.safe_load(open("compose.yaml"))
services = comp["services"]


def multi(cmd, flag):
    return [a.split("=", 1)[1] for a in cmd if a.startswith(f"--{flag}=")]


pki_cmd = services["pki"]["command"]
replicas = sorted(n for n in services if re.fullmatch(r"server-[0-9]+", n))
members = sorted(n for n in services if re.fullmatch(r"etcd-[0-9]+", n))
check(len(replicas) == 3 and len(members) == 3 and "server" not in services,
      f"compose: three replicas and three etcd members, found {replicas} and {members}")
internal = {n for n, net in (comp.get("networks") or {}).items() if (net or {}).get("internal")}
for n in members:
    e = services[n]
    check(set(e.get("networks", [])) <= internal and not e.get("ports"),
          f"compose {n}: only on an internal network, no host port (etcd is plain HTTP here)")
    check(e.get("image") == ETCD_IMAGE and "entrypoint" not in e, f"compose {n}: the image {ETCD_IMAGE}, its entrypoint")
    check(e.get("read_only") and e.get("cap_drop") == ["ALL"]
          and "no-new-privileges:true" in e.get("security_opt", []), f"compose {n}: read-only root, no capability")
    check(e.get("user") == ETCD_USER, f"compose {n}: user {ETCD_USER} (Dockerfile.etcd's, not root)")
    etcd34(f"compose {n}", e.get("command", []))
    check("etcdctl" in e.get("healthcheck", {}).get("test", [])
          and not any(a.startswith("/usr/local/") for a in e.get("healthcheck", {}).get("test", [])),
          f"compose {n}: the healthcheck runs the image's etcdctl (on PATH)")
# One build of the image (on one member; the others reuse it): compose does
# not pull an image that a service of the project builds.
builds = [n for n in members if services[n].get("build")]
check(len(builds) == 1 and services[builds[0]]["build"] == {"context": ".", "dockerfile": "Dockerfile.etcd"},
      f"compose: one etcd member builds {ETCD_IMAGE} from Dockerfile.etcd (context deploy/), found {builds}")
endpoints = ",".join(f"http://{n}:2379" for n in members)
for n in replicas:
    s = services[n]
    cmd = s["command"]
    sf = flags(cmd)
    check("client-ca" in sf and "tls-cert" in sf, f"compose {n}: must serve mutual TLS")
    check(sf.get("etcd-endpoints") == endpoints, f"compose {n}: --etcd-endpoints must be {endpoints}")
    check(sf.get("replica-id") == n and sf.get("advertise-addr") == f"{n}:{sf.get('grpc-addr', ':50051').rsplit(':', 1)[1]}",
          f"compose {n}: --replica-id={n} and --advertise-addr={n}:PORT")
    check(n in multi(pki_cmd, "server-name"), f"compose: the pki's serving certificate must name {n} (--server-name)")
    check(n in multi(pki_cmd, "replica"), f"compose: the pki must write {n}'s replica certificate (--replica {n})")
    check(sf.get("replica-tls-cert") == f"/etc/fairplace/tls/replica-{n}.crt"
          and sf.get("replica-tls-key") == f"/etc/fairplace/tls/replica-{n}.key",
          f"compose {n}: --replica-tls-cert/--replica-tls-key must be the pki's replica-{n}.crt/.key")
    check(any(v.get("source") == "pki" and v.get("target") == "/etc/fairplace/tls" for v in s.get("volumes", [])
              if isinstance(v, dict)), f"compose {n}: the pki volume at /etc/fairplace/tls")
    check("--tls-cert" in " ".join(s.get("healthcheck", {}).get("test", [])),
          f"compose {n}: the healthcheck must use a client certificate")
    check(set(s.get("networks", [])) & internal and "state-dir" not in sf,
          f"compose {n}: on etcd's network; no --state-dir (the leases are in etcd)")
check(services["server-1"].get("ports") and all(not services[n].get("ports") or
      all(":50051:" not in p and ":9464:" not in p for p in services[n]["ports"]) for n in replicas[1:]),
      "compose: server-1 keeps the host ports 50051 and 9464")
acmd = " ".join(services["agent"]["command"])
check("--tls-cert" in acmd and "--tls-ca" in acmd, "compose: the agent must present its node certificate")
check(f"--server={','.join(f'{n}:50051' for n in replicas)}" in acmd, "compose: the agent must know every replica")
pcomp = yaml.safe_load(open("prometheus/prometheus.compose.yml"))
targets = [t for sc in pcomp["scrape_configs"] if sc["job_name"] == "fairplace-server"
           for s in sc.get("static_configs", []) for t in s["targets"]]
check(sorted(targets) == [f"{n}:9464" for n in replicas], f"compose: Prometheus must scrape every replica, has {targets}")

if errors:
    print("\n".join("FAIL " + e for e in errors))
    sys.exit(1)
print(f"mutual TLS wiring OK: {len(certs)} Certificates, {len(issuers)} Issuers, trust domain {td}, "
      f"probes on :{health_port}")
