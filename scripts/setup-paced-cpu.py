#!/usr/bin/env python3
"""The setup path's CPU and thread wake-ups at a paced rate (docs/setup-path.md, "What a
flow costs at a few thousand a second").

    scripts/setup-paced-cpu.py BIN RATE SECONDS [EXTRA BENCH ARGS...]

Runs `BIN bench setup --json --nfs builtin --rate RATE --seconds SECONDS [EXTRA...]`,
samples the process's CPU time (/proc/PID/stat) and context switches (every thread's
/proc/PID/task/TID/status) every 0.5 s, and prints their medians over the paced
measurement (the last SECONDS before the drain, less the last second) beside the
bench's own figures. The bench's `cpu_us_per_flow` is the saturated measurement's; this
is the paced one's, where every flow is a batch of its own.
"""
import json
import os
import statistics
import subprocess
import sys
import time

if len(sys.argv) < 4:
    sys.exit(__doc__)
binary, rate, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
cmd = [binary, "bench", "setup", "--json", "--nfs", "builtin", "--rate", rate,
       "--seconds", str(secs)] + sys.argv[4:]
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
tick = os.sysconf("SC_CLK_TCK")


def cpu_ticks():
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            s = f.read()
        fields = s[s.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def switches():
    total = 0
    try:
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            try:
                with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                    for line in f:
                        if "ctxt_switches" in line:
                            total += int(line.split()[1])
            except OSError:
                pass
    except OSError:
        pass
    return total


samples = []
prev = (time.time(), cpu_ticks(), switches())
while p.poll() is None:
    time.sleep(0.5)
    cur = (time.time(), cpu_ticks(), switches())
    if cur[1] is not None and prev[1] is not None:
        samples.append((cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2]))
    prev = cur
out = p.stdout.read()
if p.returncode != 0 or not out:
    sys.exit(f"bench failed (exit {p.returncode})")
d = json.loads(out)
n = int(secs / 0.5)
paced = samples[-(n + 1):-2] if len(samples) > n + 2 else samples
cpu_pct = statistics.median(100 * c / tick / dt for dt, c, _ in paced)
cs_s = statistics.median(x / dt for dt, _, x in paced)
print(json.dumps({
    "paced_cpu_percent": round(cpu_pct),
    "paced_switches_per_s": round(cs_s),
    "paced_flows_per_s": d["paced_flows_per_s"],
    "p50_us": d["p50_us"],
    "p99_us": d["p99_us"],
    "failed": d["failed"],
    "flows_per_s": d["flows_per_s"],
    "cpu_us_per_flow": d["cpu_us_per_flow"],
}))
