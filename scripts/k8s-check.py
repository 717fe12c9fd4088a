#!/usr/bin/env python3
"""Check the Kubernetes manifests in deploy/k8s (`make k8s-check`, part of `make test`).

1. Schema: every object against the Kubernetes API's own OpenAPI-derived JSON schemas
   (the PyPI package kubernetes-validate ships them per release) in strict mode
   (unknown fields are errors, as `kubectl apply --validate=strict` makes them), for
   each version in --kube-versions.
2. What the API server also refuses, or what would break at run time, that a schema
   cannot see: selectors that do not select their own pod template, named ports that
   no container declares, $(VAR) references to undefined variables, ConfigMaps and
   volumes that do not exist, allowPrivilegeEscalation: false next to privileged or
   CAP_SYS_ADMIN, port names the API refuses.
3. The starfabric command lines: every --flag of every starfabric container must be
   listed by `starfabric <subcommand> --help` of the binary given with --bin, and the
   whole command line (with $(VAR)s given sample values) must parse:
   `starfabric ARGS --check-args` runs the binary's own clap parser and exits. An
   orchestrator's --autoscale string is checked the same way as `starfabric autoscale`.
   FM's --config file, when it comes from a ConfigMap here, is loaded by a real
   `starfabric fm` on loopback for a moment.
4. The etcd command line: every flag must be listed by `etcd --help` (Debian's etcd,
   which setup.sh installs; skipped with a note when there is none).
5. kustomization.yaml lists exactly the manifests in the directory.
6. Negative tests: each deploy/k8s/testdata/*.yaml is added to the manifests and the
   result must be rejected, every error naming what its `# expect:` line says.

Run with the tools venv's python (scripts/setup.sh makes it):
    .venv-tools/bin/python scripts/k8s-check.py --bin target/ci/starfabric
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "deploy" / "k8s"
DEFAULT_KUBE_VERSIONS = "1.28.0,1.33.0"

# Secrets the operator creates by hand (docs/deploy.md): not in the manifests on purpose.
EXTERNAL_SECRETS = {"starfabric-admin-token", "starfabric-join"}

# Sample values for the downward API fields the manifests use, to expand $(VAR)s in
# command lines before they are parsed.
FIELD_SAMPLES = {
    "status.podIP": "10.244.1.10",
    "status.hostIP": "192.0.2.10",
    "spec.nodeName": "node-a",
    "metadata.namespace": "starfabric",
}

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "StorageClass", "CustomResourceDefinition", "PersistentVolume"}
IANA_SVC_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def oid(doc):
    return f"{doc.get('kind')}/{name(doc)}"


def name(doc):
    return (doc.get("metadata") or {}).get("name")


def is_starfabric_image(image):
    """`starfabric:dev`, `registry.example.com/x/starfabric:1.0`, `...@sha256:...`."""
    return str(image).split("@")[0].rsplit("/", 1)[-1].split(":")[0] == "starfabric"


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# ---- 1. schemas ---------------------------------------------------------------------

_validators = {}


def validator_for(doc, version):
    """The strict schema validator of doc's kind at `version` (as kubernetes_validate
    finds it), cached; all errors are reported, not just the first."""
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    key = (doc["kind"], api, version)
    if key not in _validators:
        mm = kv_utils.major_minor(version)
        have = [v for v in kv_utils.all_versions()
                if tuple(map(int, kv_utils.major_minor(v).split("."))) <= tuple(map(int, mm.split(".")))]
        if not have:
            raise SystemExit(f"kubernetes-validate has no schemas for Kubernetes {version}")
        sdir = f"v{have[-1]}-local-strict"
        try:
            schema = kv_utils.schema_contents(
                f"kubernetes-json-schema/{sdir}/{doc['kind'].lower()}-{api}.json", version)
        except FileNotFoundError:
            _validators[key] = None
            return None
        defs = kv_utils.schema_contents(f"kubernetes-json-schema/{sdir}/_definitions.json", version)
        registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
        _validators[key] = jsonschema.validators.Draft202012Validator(schema, registry=registry)
    return _validators[key]


def check_schema(docs, versions):
    errs = []
    for d in docs:
        if not isinstance(d, dict) or "apiVersion" not in d or "kind" not in d:
            errs.append(f"{d!r:.60}: not a Kubernetes object (no apiVersion/kind)")
            continue
        for v in versions:
            val = validator_for(d, v)
            if val is None:
                errs.append(f"{oid(d)}: Kubernetes {v} has no {d['kind']} in {d['apiVersion']}")
                continue
            for e in sorted(val.iter_errors(d), key=lambda e: list(e.path)):
                where = ".".join(str(p) for p in e.absolute_path) or "(top)"
                errs.append(f"{oid(d)}: Kubernetes {v} schema: {where}: {e.message}")
    return errs


# ---- 2. what the API server and the kubelet would refuse ----------------------------

def pod_spec(doc):
    if doc.get("kind") in WORKLOAD_KINDS:
        return ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
    if doc.get("kind") == "Pod":
        return doc.get("spec") or {}
    return None


def pod_labels(doc):
    if doc.get("kind") == "Pod":
        return (doc.get("metadata") or {}).get("labels") or {}
    return (((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(spec):
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def pod_containers(docs):
    """(doc, pod spec, container) for every container of every document that runs pods."""
    for d in docs:
        spec = pod_spec(d)
        if spec is None:
            continue
        for c in containers(spec):
            yield d, spec, c


def env_names(c, docs):
    names = {e.get("name") for e in c.get("env") or []}
    for src in c.get("envFrom") or []:
        ref = src.get("configMapRef")
        if ref:
            for d in docs:
                if d.get("kind") == "ConfigMap" and name(d) == ref.get("name"):
                    names |= set((d.get("data") or {}).keys())
    return names


def probe_ports(c):
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c.get(kind) or {}
        for h in ("httpGet", "tcpSocket", "grpc"):
            if h in p and "port" in p[h]:
                yield kind, p[h]["port"]


def check_semantics(docs):
    errs = []
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.get("kind"), []).append(d)
    cms = {name(d) for d in by_kind.get("ConfigMap", [])}
    secrets = {name(d) for d in by_kind.get("Secret", [])} | EXTERNAL_SECRETS
    namespaces = {name(d) for d in by_kind.get("Namespace", [])}
    workloads = [d for d in docs if pod_spec(d) is not None]
    seen = set()
    for d in docs:
        md = d.get("metadata") or {}
        key = (d.get("kind"), md.get("name"))
        if key in seen:
            errs.append(f"{oid(d)}: defined twice")
        seen.add(key)
        if d.get("kind") not in CLUSTER_SCOPED and md.get("namespace") not in namespaces:
            errs.append(f"{oid(d)}: namespace {md.get('namespace')!r} is not one of the manifests' {sorted(namespaces)}")
    for d in workloads:
        spec = pod_spec(d)
        labels = pod_labels(d)
        sel = ((d.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if d.get("kind") != "Pod" and not selects(sel, labels):
            errs.append(f"{oid(d)}: spec.selector {sel} does not select its own template's labels {labels}")
        if d.get("kind") == "StatefulSet":
            svc = d["spec"].get("serviceName")
            match = [s for s in by_kind.get("Service", []) if name(s) == svc]
            if not match:
                errs.append(f"{oid(d)}: serviceName {svc!r}: no such Service")
            elif (match[0].get("spec") or {}).get("clusterIP") != "None":
                errs.append(f"{oid(d)}: serviceName {svc!r} is not a headless Service (clusterIP: None)")
        if spec.get("hostNetwork") and spec.get("dnsPolicy") != "ClusterFirstWithHostNet":
            errs.append(f"{oid(d)}: hostNetwork without dnsPolicy: ClusterFirstWithHostNet cannot resolve cluster Services")
        vols = {v.get("name"): v for v in spec.get("volumes") or []}
        for v in vols.values():
            if "configMap" in v and not v["configMap"].get("optional") and v["configMap"].get("name") not in cms:
                errs.append(f"{oid(d)}: volume {v['name']}: no ConfigMap {v['configMap'].get('name')!r}")
            if "secret" in v and not v["secret"].get("optional") and v["secret"].get("secretName") not in secrets:
                errs.append(f"{oid(d)}: volume {v['name']}: no Secret {v['secret'].get('secretName')!r} (neither in the manifests nor documented as created by hand)")
        claims = {name(t) for t in (d.get("spec") or {}).get("volumeClaimTemplates") or []}
        for c in containers(spec):
            cname = f"{oid(d)} container {c.get('name')}"
            ports = {p.get("name") for p in c.get("ports") or [] if p.get("name")}
            for p in c.get("ports") or []:
                n = p.get("name")
                if n is not None and (len(n) > 15 or not IANA_SVC_NAME.match(n)):
                    errs.append(f"{cname}: port name {n!r} is not an IANA_SVC_NAME (at most 15 characters, a-z0-9-)")
            for kind, port in probe_ports(c):
                if isinstance(port, str) and port not in ports:
                    errs.append(f"{cname}: {kind} port {port!r} is not a port of the container")
            for m in c.get("volumeMounts") or []:
                if m.get("name") not in vols and m.get("name") not in claims:
                    errs.append(f"{cname}: volumeMount {m.get('name')!r}: no such volume")
            envs = env_names(c, docs)
            for word in list(c.get("command") or []) + list(c.get("args") or []):
                for var in VAR_REF.findall(str(word)):
                    if var not in envs:
                        errs.append(f"{cname}: $({var}) is not an environment variable of the container (it would stay as the literal text)")
            for e in c.get("env") or []:
                ref = ((e.get("valueFrom") or {}).get("configMapKeyRef") or {})
                if ref and not ref.get("optional") and ref.get("name") not in cms:
                    errs.append(f"{cname}: env {e.get('name')}: no ConfigMap {ref.get('name')!r}")
            for src in c.get("envFrom") or []:
                ref = src.get("configMapRef")
                if ref and not ref.get("optional") and ref.get("name") not in cms:
                    errs.append(f"{cname}: envFrom: no ConfigMap {ref.get('name')!r}")
            sc = c.get("securityContext") or {}
            caps = {x.upper().removeprefix("CAP_") for x in (sc.get("capabilities") or {}).get("add") or []}
            if sc.get("allowPrivilegeEscalation") is False and (sc.get("privileged") or "SYS_ADMIN" in caps):
                errs.append(f"{cname}: the API server refuses allowPrivilegeEscalation: false with privileged or CAP_SYS_ADMIN")
    for s in by_kind.get("Service", []):
        sel = (s.get("spec") or {}).get("selector") or {}
        targets = [w for w in workloads if selects(sel, pod_labels(w))]
        if not targets:
            errs.append(f"{oid(s)}: selector {sel} selects no pod template")
        for p in (s.get("spec") or {}).get("ports") or []:
            tp = p.get("targetPort")
            if isinstance(tp, str):
                for w in targets:
                    names = {q.get("name") for c in containers(pod_spec(w)) for q in c.get("ports") or []}
                    if tp not in names:
                        errs.append(f"{oid(s)}: targetPort {tp!r} is not a port of {oid(w)}")
    for p in by_kind.get("PodDisruptionBudget", []):
        sel = ((p.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not any(selects(sel, pod_labels(w)) for w in workloads):
            errs.append(f"{oid(p)}: selector {sel} selects no pod template")
    return errs


# ---- 3. starfabric command lines ----------------------------------------------------

_help = {}


def help_text(binary, sub):
    if sub not in _help:
        r = subprocess.run([binary, sub, "--help"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            _help[sub] = None
        else:
            _help[sub] = r.stdout
    return _help[sub]


def expand(words, c, workload_name, docs):
    """$(VAR)s replaced by sample values, as the kubelet would."""
    values = {}
    for e in c.get("env") or []:
        if "value" in e:
            values[e["name"]] = e["value"]
        fr = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if fr == "metadata.name":
            values[e["name"]] = f"{workload_name}-0"
        elif fr in FIELD_SAMPLES:
            values[e["name"]] = FIELD_SAMPLES[fr]
    for src in c.get("envFrom") or []:
        ref = src.get("configMapRef")
        for d in docs:
            if ref and d.get("kind") == "ConfigMap" and name(d) == ref.get("name"):
                values.update(d.get("data") or {})
    return [VAR_REF.sub(lambda m: values.get(m.group(1), m.group(0)), str(w)) for w in words]


def flags_of(words):
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def run_binary(argv, timeout=30):
    env = dict(os.environ, RUST_BACKTRACE="0", STARFABRIC_LOG="error")
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout} s"
    out = (r.stdout + r.stderr).strip()
    return r.returncode, out


def gist(out, rc):
    """An error output in one line: its first lines that say something."""
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    lines = [l for l in lines if not l.startswith(("Usage:", "For more information"))]
    return " ".join(lines[:3]) if lines else f"exit code {rc}"


def check_cli(binary, cname, words):
    """words: the command line after `starfabric`. Every flag must be in the
    subcommand's --help, and the whole line must parse (`--check-args`)."""
    errs = []
    if not words or words[0].startswith("-"):
        return [f"{cname}: starfabric without a subcommand as its first argument: {words}"]
    sub = words[0]
    text = help_text(binary, sub)
    if text is None:
        return [f"{cname}: `starfabric {sub} --help` failed: no such subcommand"]
    for f in flags_of(words[1:]):
        if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", text):
            errs.append(f"{cname}: starfabric {sub} has no flag {f} (not in `starfabric {sub} --help`)")
    rc, out = run_binary([binary] + words + ["--check-args"])
    if rc != 0:
        errs.append(f"{cname}: `starfabric {shlex.join(words)}` does not parse: {gist(out, rc)}")
    return errs


def check_fm_config(binary, cname, words, c, spec, docs):
    """FM's --config, when a ConfigMap here provides it: a real FM loads it on loopback
    (it parses the file with unknown keys refused, then serves until --duration)."""
    cfg = next((w.split("=", 1)[1] for w in words if w.startswith("--config=")), None)
    if cfg is None and "--config" in words:
        cfg = words[words.index("--config") + 1]
    if cfg is None:
        return []
    vols = {v.get("name"): v for v in spec.get("volumes") or []}
    for m in c.get("volumeMounts") or []:
        mp = m.get("mountPath", "").rstrip("/") + "/"
        if not cfg.startswith(mp):
            continue
        cm = (vols.get(m.get("name")) or {}).get("configMap")
        if not cm:
            return []
        data = next((d.get("data") or {} for d in docs
                     if d.get("kind") == "ConfigMap" and name(d) == cm.get("name")), {})
        key = cfg[len(mp):]
        if key not in data:
            return [f"{cname}: --config {cfg}: ConfigMap {cm.get('name')!r} has no key {key!r}"]
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "fm.json"
            p.write_text(data[key])
            # Only the configuration is on trial here, not the manifest's TLS flags
            # (checked with the rest of its arguments), so plaintext is asked for.
            rc, out = run_binary([binary, "fm", "--config", str(p), "--listen", "127.0.0.1:0",
                                  "--duration", "0", "--insecure"])
        if rc != 0:
            return [f"{cname}: --config {cfg} (ConfigMap {cm.get('name')}): starfabric fm refuses it: {gist(out, rc)}"]
        return []
    return []


def check_starfabric(docs, binary):
    errs = []
    checked = 0
    for d, spec, c in pod_containers(docs):
        cmd = list(c.get("command") or [])
        if cmd and os.path.basename(cmd[0]) == "starfabric":
            line = cmd[1:] + list(c.get("args") or [])
        elif not cmd and is_starfabric_image(c.get("image", "")):
            line = list(c.get("args") or [])  # the image's ENTRYPOINT is starfabric
        else:
            continue
        cname = f"{oid(d)} container {c.get('name')}"
        words = expand(line, c, name(d), docs)
        errs += check_cli(binary, cname, words)
        checked += 1
        for i, w in enumerate(words):
            inner = None
            if w.startswith("--autoscale="):
                inner = w.split("=", 1)[1]
            elif w == "--autoscale" and i + 1 < len(words):
                inner = words[i + 1]
            if inner is not None:
                errs += check_cli(binary, cname + " --autoscale", ["autoscale"] + shlex.split(inner))
        if words and words[0] == "fm":
            errs += check_fm_config(binary, cname, words, c, spec, docs)
    return errs, checked


# ---- 4. etcd command line -----------------------------------------------------------

def check_etcd(docs, etcd):
    errs = []
    if etcd is None:
        return errs, "skipped: no etcd binary (scripts/setup.sh installs etcd-server)"
    r = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30)
    text = r.stdout + r.stderr
    n = 0
    for d, _, c in pod_containers(docs):
        cmd = list(c.get("command") or [])
        if not cmd or os.path.basename(cmd[0]) != "etcd":
            continue
        n += 1
        for f in flags_of(list(c.get("args") or [])):
            if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", text):
                errs.append(f"{oid(d)} container {c.get('name')}: etcd has no flag {f} (not in `{etcd} --help`)")
    return errs, f"{n} etcd container(s) against {etcd}"


# ---- 5. kustomization ---------------------------------------------------------------

def check_kustomization(directory):
    k = directory / "kustomization.yaml"
    if not k.exists():
        return []
    listed = set((yaml.safe_load(k.read_text()) or {}).get("resources") or [])
    present = {p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"}
    errs = [f"kustomization.yaml lists {f}, which does not exist" for f in sorted(listed - present)]
    errs += [f"kustomization.yaml does not list {f}" for f in sorted(present - listed)]
    return errs


# ---- the run ------------------------------------------------------------------------

def check_all(docs, a):
    errs = check_schema(docs, a.versions)
    errs += check_semantics(docs)
    sf, n = check_starfabric(docs, a.bin)
    errs += sf
    etcd_errs, etcd_note = check_etcd(docs, a.etcd)
    errs += etcd_errs
    return errs, n, etcd_note


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the starfabric binary to check command lines with")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="manifest directory (default deploy/k8s)")
    ap.add_argument("--kube-versions", default=DEFAULT_KUBE_VERSIONS,
                    help=f"Kubernetes versions to validate against (default {DEFAULT_KUBE_VERSIONS})")
    ap.add_argument("--etcd", default=shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None))
    ap.add_argument("--no-negative", action="store_true", help="skip the testdata/ negative cases")
    a = ap.parse_args()
    a.versions = [v.strip() for v in a.kube_versions.split(",") if v.strip()]
    t0 = time.monotonic()
    directory = Path(a.dir)
    if not os.access(a.bin, os.X_OK):
        sys.exit(f"k8s-check: {a.bin} is not an executable starfabric binary")
    rc, out = run_binary([a.bin, "--check-args", "up"])
    if rc != 0:
        sys.exit(f"k8s-check: {a.bin} has no --check-args (an old binary?): {out}")

    files = sorted(p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = []
    for p in files:
        docs += load_docs(p)
    errs = check_kustomization(directory)
    more, n, etcd_note = check_all(docs, a)
    errs += more
    print(f"k8s-check: {len(docs)} objects in {len(files)} files of {directory.relative_to(ROOT) if directory.is_relative_to(ROOT) else directory}; "
          f"schemas: Kubernetes {', '.join(a.versions)} (kubernetes-validate {kv_utils_version()}, strict); "
          f"{n} starfabric command lines; etcd: {etcd_note}")
    for e in errs:
        print(f"  FAIL {e}")

    neg_fail = 0
    neg = sorted((directory / "testdata").glob("*.yaml")) if not a.no_negative else []
    for p in neg:
        m = re.search(r"^# expect: (.+)$", p.read_text(), re.M)
        if not m:
            print(f"  FAIL testdata/{p.name}: no '# expect: TEXT' line")
            neg_fail += 1
            continue
        want = m.group(1).strip()
        bad, _, _ = check_all(docs + load_docs(p), a)
        bad = [e for e in bad if e not in errs]
        wrong = [e for e in bad if want not in e]
        if not bad:
            print(f"  FAIL testdata/{p.name}: accepted, but it must be rejected ({want})")
            neg_fail += 1
        elif wrong:
            print(f"  FAIL testdata/{p.name}: rejected, but not only for {want!r}:")
            for e in wrong:
                print(f"         {e}")
            neg_fail += 1
        else:
            print(f"  ok   testdata/{p.name}: rejected: {bad[0]}")
    dt = time.monotonic() - t0
    total_fail = len(errs) + neg_fail
    print(f"k8s-check: manifests {'accepted' if not errs else f'REJECTED ({len(errs)} errors)'}, "
          f"{len(neg) - neg_fail} of {len(neg)} bad manifests rejected as expected, in {dt:.1f} s")
    passed = (0 if errs else 1) + len(neg) - neg_fail
    print(f"k8s-check: {passed} passed, {(1 if errs else 0) + neg_fail} failed")
    sys.exit(1 if total_fail else 0)


def kv_utils_version():
    try:
        from importlib.metadata import version
        return version("kubernetes-validate")
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
