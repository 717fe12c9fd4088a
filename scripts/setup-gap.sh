#!/usr/bin/env bash
# Where an idle node's flow setup spends its time, on the netns testbed
# (docs/setup-path.md, "An idle worker wakes for its replies"). Needs root and tshark
# (scripts/setup.sh installs it). Uses only the testbed's namespaces; tears it down on
# exit, also on failure.
#
#   scripts/setup-gap.sh BIN [N]            N (10) curl connections 200 ms apart, tshark
#                                            on the router's link to the PP node; per SYN:
#                                            SYN in -> request out -> reply in -> SYN out
#   scripts/setup-gap.sh --connect BIN [N]  N (200) curl connections 20 ms apart; p50,
#                                            p90, p99 and max of connect(2) time
#
# BIN is a starfabric binary (target/release/starfabric or target/ci/starfabric).
set -euo pipefail

mode=gap
if [ "${1:-}" = "--connect" ]; then
    mode=connect
    shift
fi
BIN=${1:?usage: setup-gap.sh [--connect] BIN [N]}
if [ "$mode" = gap ]; then N=${2:-10}; else N=${2:-200}; fi
out=$(mktemp -d)
trap '"$BIN" testbed down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

"$BIN" testbed up --tenants 1 --chain snat >"$out/up.log" 2>&1 || {
    tail "$out/up.log" >&2
    exit 1
}
sleep 2

if [ "$mode" = connect ]; then
    for _ in $(seq 1 "$N"); do
        ip netns exec sftb-c0 curl -s -o /dev/null -m 3 -w "%{time_connect}\n" http://198.18.200.10/
        sleep 0.02
    done >"$out/conn.txt"
    sort -n "$out/conn.txt" | awk '{a[NR]=$1*1000} END {
        printf "n=%d p50=%.3f p90=%.3f p99=%.3f max=%.3f ms\n",
            NR, a[int(NR*0.5)], a[int(NR*0.9)], a[int(NR*0.99)], a[NR]}'
    exit 0
fi

command -v tshark >/dev/null || { echo "tshark is not installed (scripts/setup.sh)" >&2; exit 1; }
secs=$((N / 5 + 6))
ip netns exec sftb-rt timeout "$secs" tshark -l -i dpp -n -T fields -e frame.time_epoch \
    -e ip.src -e ip.dst -e tcp.srcport -e tcp.dstport -e tcp.flags.syn -e tcp.flags.ack \
    -e tcp.len >"$out/cap.txt" 2>/dev/null &
cap=$!
sleep 2
for _ in $(seq 1 "$N"); do
    ip netns exec sftb-c0 curl -s -o /dev/null -m 3 http://198.18.200.10/
    sleep 0.2
done
wait "$cap" || true
python3 - "$out/cap.txt" <<'PY'
import sys
# The link carries the clients' VXLAN (tshark repeats outer and inner fields; the
# inner is last) and the PP node's gRPC session to FM on TCP 7000.
ev = []
for line in open(sys.argv[1]):
    r = line.rstrip("\n").split("\t")
    if len(r) < 8:
        continue
    last = [f.split(",")[-1] for f in r]
    if last[3] == "":
        continue
    ev.append((float(last[0]), *last[1:]))
def big(x):  # a request or reply batch, not an ACK or a heartbeat's stats
    return x[7].isdigit() and int(x[7]) > 50
print("SYN in -> request out -> reply in -> SYN out (us)")
for i, (t, src, dst, sp, dp, syn, ack, ln) in enumerate(ev):
    if dp == "80" and syn in ("1", "True") and ack in ("0", "False") and src.startswith("198.19.1."):
        req = next((x for x in ev[i:] if x[4] == "7000" and big(x)), None)
        rep = next((x for x in ev[i:] if x[3] == "7000" and big(x)), None)
        out = next((x for x in ev[i:] if x[1].startswith("198.18.201.") and x[5] in ("1", "True")), None)
        if req and rep and out:
            print("%6.0f %6.0f %6.0f  total %6.0f" % ((req[0] - t) * 1e6, (rep[0] - req[0]) * 1e6,
                                                   (out[0] - rep[0]) * 1e6, (out[0] - t) * 1e6))
PY
