#!/usr/bin/env python3
"""Write a connection trace for `starfabric bench setup --workload FILE`.

docs/benchmarks.md, "Setup workload", gives the format. This writes its two files: a
CSV of new flows (proto,src,sport,dst,dport,at_us) and the workload JSON that names it.
Arrivals are a Poisson process at --rate (exponential gaps, seeded), or evenly spaced
with --even; --tcp is the share of TCP flows (their first packet is a SYN), the rest
UDP; sources are spread over --sources addresses of 10.64.0.0/10, one new source port
per flow of a source. Every 5-tuple is new, as the bench requires.

    python3 scripts/setup-trace.py --flows 400000 --rate 50000 --out /tmp/poisson
    starfabric bench setup --json --nfs builtin --workload /tmp/poisson.json

A trace recorded elsewhere (conntrack -E, a flow log, a pcap's SYNs) can be written to
the same CSV columns and named by a workload JSON the same way.
"""

import argparse
import ipaddress
import json
import random
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flows", type=int, default=400_000, help="flows to write")
    ap.add_argument("--rate", type=float, default=50_000.0, help="mean new flows per second")
    ap.add_argument("--even", action="store_true", help="evenly spaced, not Poisson")
    ap.add_argument("--tcp", type=float, default=0.0, help="share of TCP flows, 0..1")
    ap.add_argument("--sources", type=int, default=1024, help="client addresses")
    ap.add_argument("--dst", default="198.19.0.100", help="the service's address")
    ap.add_argument("--udp-port", type=int, default=53)
    ap.add_argument("--tcp-port", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--name", default=None, help="the workload's name")
    ap.add_argument("--nfs", default=None, help="a JSON file with the chain's NFs (a list)")
    ap.add_argument("--out", required=True, help="path prefix: writes OUT.csv and OUT.json")
    a = ap.parse_args()
    if a.flows <= 0 or a.rate <= 0 or not 0.0 <= a.tcp <= 1.0 or a.sources <= 0:
        print("flows, rate and sources must be > 0, tcp in [0, 1]", file=sys.stderr)
        return 2
    ports = 65535 - 1024 + 1
    if a.flows > a.sources * ports:
        print(f"{a.sources} sources hold at most {a.sources * ports} flows", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    base = int(ipaddress.IPv4Address("10.64.0.0"))
    next_port = [1024] * a.sources
    t = 0.0
    with open(a.out + ".csv", "w") as f:
        f.write("proto,src,sport,dst,dport,at_us\n")
        for i in range(a.flows):
            s = rng.randrange(a.sources)
            while next_port[s] > 65535:
                s = (s + 1) % a.sources
            sport = next_port[s]
            next_port[s] += 1
            tcp = rng.random() < a.tcp
            proto, dport = ("tcp", a.tcp_port) if tcp else ("udp", a.udp_port)
            f.write(f"{proto},{ipaddress.IPv4Address(base + s)},{sport},{a.dst},{dport},{t:.3f}\n")
            t += 1e6 / a.rate if a.even else rng.expovariate(a.rate) * 1e6
    w = {
        "version": 1,
        "name": a.name or f"{'even' if a.even else 'Poisson'} {a.rate:g}/s, {a.flows} flows",
        "flows_csv": a.out.rsplit("/", 1)[-1] + ".csv",
        "paced": "trace",
    }
    if a.nfs:
        with open(a.nfs) as f:
            w["nfs"] = json.load(f)
    with open(a.out + ".json", "w") as f:
        json.dump(w, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
