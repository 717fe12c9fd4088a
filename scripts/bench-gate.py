#!/usr/bin/env python3
"""Run the benches and fail when a goal in bench/goals.json is missed.

    scripts/bench-gate.py [--bin PATH] [--only BENCH[,BENCH]] [--from DIR] [--out DIR]

Each bench named by a goal runs once (`starfabric bench NAME --json`, the argv in
goals.json); its JSON is kept in --out (default: a temporary directory) and every goal
over it is checked. --from DIR checks JSON files saved earlier (DIR/NAME.json) instead of
running the benches. The table printed says, per goal, the value, the bound and
pass/FAIL/missing; the exit status is 1 when any goal failed or had no value, 2 on bad
usage. The netns benches (scaling, e2e, isolation) need root and the testbed's tools
(scripts/setup.sh installs them). `make bench-gate` runs it; CI does not.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lookup(doc, path):
    """The value at a dotted path, or None."""
    v = doc
    for part in path.split("."):
        if isinstance(v, dict) and part in v:
            v = v[part]
        else:
            return None
    return v


def bound(expr, doc):
    """A number, or an expression over {dotted.paths} with max/min (None if a path is missing)."""
    if isinstance(expr, (int, float)):
        return float(expr)
    missing = []

    def sub(m):
        v = lookup(doc, m.group(1))
        if not isinstance(v, (int, float)):
            missing.append(m.group(1))
            return "0"
        return repr(float(v))

    text = re.sub(r"\{([A-Za-z0-9_.]+)\}", sub, expr)
    if missing:
        return None
    if not re.fullmatch(r"[0-9eE+\-*/().,\s maxin]*", text):
        raise SystemExit(f"bench-gate: bad bound expression {expr!r}")
    return float(eval(text, {"__builtins__": {}}, {"max": max, "min": min}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/starfabric"))
    ap.add_argument("--goals", default=os.path.join(ROOT, "bench/goals.json"))
    ap.add_argument("--only", default="", help="comma-separated bench names")
    ap.add_argument("--from", dest="src", help="directory of saved NAME.json outputs")
    ap.add_argument("--out", help="directory to keep the outputs in")
    a = ap.parse_args()

    spec = json.load(open(a.goals))
    goals = spec["goals"]
    names = [n for n in spec["benches"] if any(g["bench"] == n for g in goals)]
    if a.only:
        want = a.only.split(",")
        unknown = [w for w in want if w not in spec["benches"]]
        if unknown:
            print(f"bench-gate: unknown bench {unknown}; known: {list(spec['benches'])}", file=sys.stderr)
            return 2
        names = [n for n in names if n in want]
    out = a.out or tempfile.mkdtemp(prefix="bench-gate-")
    os.makedirs(out, exist_ok=True)

    results = {}
    for name in names:
        if a.src:
            path = os.path.join(a.src, f"{name}.json")
            try:
                results[name] = json.load(open(path))
            except (OSError, ValueError) as e:
                print(f"bench-gate: {path}: {e}", file=sys.stderr)
                results[name] = None
            continue
        argv = [a.bin] + spec["benches"][name]
        print(f"bench-gate: running {' '.join(argv)}", file=sys.stderr, flush=True)
        p = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        path = os.path.join(out, f"{name}.json")
        with open(path, "w") as f:
            f.write(p.stdout)
        try:
            results[name] = json.loads(p.stdout) if p.returncode == 0 else None
        except ValueError:
            results[name] = None
        if results[name] is None:
            print(f"bench-gate: {name} failed (exit {p.returncode}); output in {path}", file=sys.stderr)

    failed = 0
    rows = []
    for g in goals:
        if g["bench"] not in names:
            continue
        doc = results.get(g["bench"])
        v = lookup(doc, g["value"]) if doc is not None else None
        if "max" in g:
            b, op = (bound(g["max"], doc) if doc is not None else None), "<="
        else:
            b, op = (bound(g["min"], doc) if doc is not None else None), ">="
        if not isinstance(v, (int, float)) or b is None:
            verdict = "missing"
        elif (v <= b) if op == "<=" else (v >= b):
            verdict = "pass"
        else:
            verdict = "FAIL"
        if verdict != "pass":
            failed += 1
        shown = "-" if not isinstance(v, (int, float)) else f"{v:.4g}"
        target = "-" if b is None else f"{op} {b:.4g}"
        rows.append((verdict, g["bench"], g["name"], shown, target, g.get("unit", ""), g.get("doc", "")))

    widths = [max(len(r[i]) for r in rows) if rows else 0 for i in range(5)]
    for r in rows:
        print("  ".join(r[i].ljust(widths[i]) for i in range(5)) + f"  {r[5]}  ({r[6]})")
    print(f"bench-gate: {len(rows) - failed} of {len(rows)} goals met; outputs in {a.src or out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
