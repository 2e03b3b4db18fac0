#!/usr/bin/env python3
"""Dashboards: JSON, unique panel ids, titles, refIds, ${datasource}, and each
target's expr (variables substituted) as a recording rule for `promtool check
rules`. usage: check_exprs.py [DASHBOARD.json ...] (default: dashboards/*.json)"""
import json, os, re, subprocess, sys, tempfile
from pathlib import Path

SUBST = [(r"\$\{?__rate_interval\}?", "1m"), (r"\$\{?__interval\}?", "1m"),
         (r"\$\{?__range\}?", "1h"), (r"\$\{?node(?::\w+)?\}?", "node-1")]
DS = {"type": "prometheus", "uid": "${datasource}"}


def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))  # rows may nest panels


def check(path, problems, exprs):
    d = json.loads(Path(path).read_text())
    names = [v.get("name") for v in d.get("templating", {}).get("list", [])]
    if "datasource" not in names or not d.get("uid"):
        problems.append(f"{path}: no uid or no 'datasource' variable")
    ids = set()
    for p in panels(d.get("panels", [])):
        where = f"{path}: panel {p.get('id')} {p.get('title')!r}"
        if p.get("id") in ids or p.get("id") is None:
            problems.append(f"{where}: missing or duplicate id")
        ids.add(p.get("id"))
        if not p.get("title"):
            problems.append(f"{where}: no title")
        if p.get("type") == "row":
            continue
        if p.get("datasource") != DS:
            problems.append(f"{where}: datasource is not {DS}")
        if not p.get("targets"):
            problems.append(f"{where}: no targets")
        refs = [t.get("refId") for t in p.get("targets", [])]
        if None in refs or len(set(refs)) != len(refs):
            problems.append(f"{where}: missing or duplicate refId")
        for t in p.get("targets", []):
            if not t.get("expr"):
                problems.append(f"{where}: target {t.get('refId')} has no expr")
                continue
            e = t["expr"]
            for pat, val in SUBST:
                e = re.sub(pat, val, e)
            if "$" in e:
                problems.append(f"{where}: unknown variable left in {e!r}")
            exprs.append((where, e))


def main():
    here = Path(__file__).resolve().parent
    files = sys.argv[1:] or sorted(str(p) for p in (here / "dashboards").glob("*.json"))
    problems, exprs = [], []
    for f in files:
        try:
            check(f, problems, exprs)
        except (OSError, ValueError) as err:
            problems.append(f"{f}: {err}")
    rules = {"groups": [{"name": "dashboard_exprs", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as tmp:
        json.dump(rules, tmp)  # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", tmp.name], capture_output=True, text=True)
    os.unlink(tmp.name)
    if r.returncode != 0:
        problems.append("promtool check rules failed:\n" + r.stdout + r.stderr)
    for p in problems:
        print("FAIL", p)
    print(f"{len(files)} dashboards, {len(exprs)} exprs: " + ("FAILED" if problems else "OK"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
