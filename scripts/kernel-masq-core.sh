#!/usr/bin/env bash
# The kernel's per-core forwarding rate for plain (not tunnelled) IPv4 UDP, with and
# without nftables masquerade: the measurement behind issue 18's "reconcile the per-core
# kernel baseline" (docs/xdp.md, "The kernel's per-core baseline").
#
#   scripts/kernel-masq-core.sh [STARFABRIC_BIN] [SECS_PER_STEP]
#
# Three namespaces of its own (prefix sfkm<pid>): gen --veth-- nat --veth-- sink.
# The sender is `starfabric bench xdp-gen` (the kernel's XDP live-frames test run, the
# sender of `bench e2e`'s per-core rate) on CPU 0, writing 110-byte frames (the size of
# the e2e bench's VXLAN frames; IPv4 + UDP to port 9, 16 source ports) straight into
# the nat namespace's receive ring. The nat namespace forwards them (GRO on and NAPI
# threaded, its kthread pinned to CPU 1 at nice -20, as `bench e2e` does) to the sink,
# whose kernel drops them at once (they carry another host's MAC); the count is the
# sink veth's rx_packets. So everything the forwarding kernel does per packet runs on
# CPU 1, as in `bench e2e`, but with no VXLAN decapsulation or encapsulation.
#
# Each variant (forward, masquerade) is offered fixed loads of 2 s each and then an
# unpaced run; it prints offered -> forwarded per step. Needs root, iproute2, nft,
# ethtool, taskset. Addresses are in 198.18.240.0/23. Everything is removed on exit.
set -euo pipefail
BIN=${1:-target/release/starfabric}
SECS=${2:-2}
[ -x "$BIN" ] || { echo "no starfabric binary at $BIN (build it, or pass its path)" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "needs 2 CPUs (sender on 0, forwarding on 1)" >&2; exit 2; }
P=sfkm$$
G=${P}g N=${P}n S=${P}s
# ksoftirqd/1 runs at nice -20 for the run (as in `bench e2e`); its old value comes back.
SOFTIRQ=$(ps -eLo pid=,comm= | awk '$2 == "ksoftirqd/1" {print $1}')
SOFTIRQ_NICE=$( [ -n "$SOFTIRQ" ] && ps -o ni= -p "$SOFTIRQ" | tr -d ' ' )
cleanup() {
  for ns in "$G" "$N" "$S"; do ip netns del "$ns" 2>/dev/null || true; done
  if [ -n "$SOFTIRQ" ] && [ -n "$SOFTIRQ_NICE" ]; then
    renice -n "$SOFTIRQ_NICE" -p "$SOFTIRQ" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
for ns in "$G" "$N" "$S"; do ip netns add "$ns"; done
ip link add g0 netns "$G" type veth peer name in0 netns "$N"
ip link add out0 netns "$N" type veth peer name s0 netns "$S"
ip -n "$G" addr add 198.18.240.1/24 dev g0
ip -n "$N" addr add 198.18.240.2/24 dev in0
ip -n "$N" addr add 198.18.241.1/24 dev out0
ip -n "$S" addr add 198.18.241.2/24 dev s0
for l in "$G g0" "$N in0" "$N out0" "$S s0"; do set -- $l; ip -n "$1" link set "$2" up; done
ip netns exec "$N" sysctl -qw net.ipv4.ip_forward=1
# The sink's address resolves to a MAC that is not the sink's: its kernel drops every
# frame in ip_rcv (another host's), after the veth has counted it.
ip -n "$N" neigh replace 198.18.241.2 lladdr 02:00:00:00:00:99 dev out0 nud permanent
ip netns exec "$N" ethtool -K in0 gro on >/dev/null
ip netns exec "$N" sh -c 'echo 1 > /sys/class/net/in0/threaded'
sleep 0.2
NAPI=$(ps -eLo pid=,comm= | awk '$2 ~ /^napi\/in0-/ {print $1}')
[ -n "$NAPI" ] || { echo "in0's NAPI kthread did not appear" >&2; exit 1; }
for p in $NAPI; do taskset -p -c 1 "$p" >/dev/null; renice -n -20 -p "$p" >/dev/null; done
[ -z "$SOFTIRQ" ] || renice -n -20 -p "$SOFTIRQ" >/dev/null

mac() { ip -n "$1" -o link show "$2" | sed -E 's/.*link\/ether ([0-9a-f:]+).*/\1/'; }
DMAC=$(mac "$N" in0 | tr -d :)
SMAC=$(mac "$G" g0 | tr -d :)
# IPv4 header (total length 96, DF, TTL 64, UDP) 198.18.240.1 -> 198.18.241.2 with its
# checksum; UDP 10000 -> 9, length 76, checksum 0; 68 zero bytes of payload.
FRAME=$(python3 - "$DMAC" "$SMAC" <<'EOF'
import struct, sys
dmac, smac = sys.argv[1], sys.argv[2]
ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 96, 0, 0x4000, 64, 17, 0,
                           bytes([198, 18, 240, 1]), bytes([198, 18, 241, 2])))
s = sum(struct.unpack("!10H", ip))
s = (s & 0xffff) + (s >> 16); s = (s & 0xffff) + (s >> 16)
ip[10:12] = struct.pack("!H", ~s & 0xffff)
udp = struct.pack("!HHHH", 10000, 9, 76, 0) + bytes(68)
frame = bytes.fromhex(dmac) + bytes.fromhex(smac) + b"\x08\x00" + bytes(ip) + udp
assert len(frame) == 110, len(frame)
print(frame.hex())
EOF
)

count() { ip netns exec "$S" cat /sys/class/net/s0/statistics/rx_packets; }
step() { # rate (0: unpaced) -> prints "offered->forwarded" in pps
  local rate=$1 run
  run=$(python3 -c "print($SECS + 0.8)")
  ip netns exec "$G" nice -n -20 taskset -c 0 "$BIN" bench xdp-gen --dev g0 --frame "$FRAME" \
    --flows 16 --secs "$run" --rate "$rate" >/dev/null 2>&1 &
  local gen=$!
  sleep 0.4
  local a t0 b t1
  a=$(count); t0=$(date +%s.%N)
  sleep "$SECS"
  b=$(count); t1=$(date +%s.%N)
  wait "$gen" || true
  local label=unpaced
  [ "$rate" = 0 ] || label="$((rate / 1000))k"
  python3 -c "print('$label->%.0fk' % (($b - $a) / ($t1 - $t0) / 1e3))"
}
variant() {
  local name=$1
  local line="$name:"
  for r in 200000 400000 600000 800000 1000000 1200000 0; do
    line="$line $(step "$r")"
  done
  echo "$line"
}
variant "forward"
ip netns exec "$N" nft -f - <<'EOF'
table ip sfkm {
  chain post {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "out0" masquerade
  }
}
EOF
variant "masquerade"
