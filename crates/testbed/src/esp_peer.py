#!/usr/bin/python3
"""A userspace ESP tunnel endpoint (RFC 4303 tunnel mode, AES-GCM per RFC 4106) for the
IPsec remote site on kernels built without ESP (CONFIG_INET_ESP) or GCM: scapy's
scapy.layers.ipsec, whose AES-GCM is the Python `cryptography` package (OpenSSL), i.e.
an implementation independent of starfabric's.

    esp_peer.py SA_FILE TUN_NAME

It opens TUN_NAME (the caller routes the VPC's prefixes into it and sets its MTU),
seals every packet read from it with the outbound SA and sends it to the peer through a
raw socket, and opens every ESP packet the namespace receives with the inbound SA of its
SPI, writing the inner packet into the TUN device for the kernel to forward. SA_FILE is
JSON: {"local", "peer", "out": {"spi", "key"}, "in": [{"spi", "key"}, ...]} with keys as
RFC 4106 KEYMAT hex (key + 4-byte salt); it is read again whenever it changes, which is
how the test rekeys this side (as `ip xfrm state add/delete` would). An SA whose SPI and
key stay keeps its sequence number. Counters go to stdout every second.
"""
import fcntl
import json
import os
import select
import socket
import struct
import sys
import time

from scapy.layers.inet import IP
from scapy.layers.ipsec import ESP, SecurityAssociation

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def sa_for(spi, key, local, peer):
    return SecurityAssociation(ESP, spi=spi, crypt_algo="AES-GCM",
                               crypt_key=bytes.fromhex(key.removeprefix("0x")),
                               auth_algo="NULL", tunnel_header=IP(src=local, dst=peer))


def main():
    sa_file, tun_name = sys.argv[1], sys.argv[2]
    tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH", tun_name.encode(), IFF_TUN | IFF_NO_PI))
    rx = socket.socket(socket.AF_INET, socket.SOCK_RAW, 50)
    rx.setblocking(False)
    tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    state = {"mtime": None, "out": None, "in": {}, "peer": None, "keys": {}}
    n = {"out": 0, "in": 0, "auth_failed": 0, "unknown_spi": 0, "errors": 0, "reloads": 0}

    def reload():
        try:
            m = os.stat(sa_file).st_mtime_ns
        except FileNotFoundError:
            return
        if m == state["mtime"]:
            return
        with open(sa_file) as f:
            c = json.load(f)
        state["mtime"] = m
        local, peer = c["local"], c["peer"]
        keys = state["keys"]
        o = c["out"]
        ident = ("out", o["spi"], o["key"])
        if state["out"] is None or state["out"][0] != ident:
            state["out"] = (ident, sa_for(o["spi"], o["key"], local, peer))
        ins = {}
        for s in c["in"]:
            ident = ("in", s["spi"], s["key"])
            old = keys.get(ident)
            ins[s["spi"]] = old or sa_for(s["spi"], s["key"], peer, local)
            keys[ident] = ins[s["spi"]]
        state["in"] = ins
        state["peer"] = peer
        n["reloads"] += 1
        print(f"esp-peer: SAs out={o['spi']:#x} in={[hex(s) for s in ins]}", flush=True)

    reload()
    print("esp-peer: ready", flush=True)
    last = time.monotonic()
    while True:
        r, _, _ = select.select([tun, rx], [], [], 0.1)
        reload()
        if tun in r:
            for _ in range(64):
                try:
                    pkt = os.read(tun, 65535)
                except BlockingIOError:
                    break
                if not pkt or pkt[0] >> 4 != 4 or state["out"] is None:
                    continue
                try:
                    e = state["out"][1].encrypt(IP(pkt))
                    tx.sendto(bytes(e), (state["peer"], 0))
                    n["out"] += 1
                except Exception as ex:  # a send error must not stop the endpoint
                    n["errors"] += 1
                    print(f"esp-peer: send: {ex}", flush=True)
        if rx in r:
            for _ in range(64):
                try:
                    data = rx.recv(65535)
                except BlockingIOError:
                    break
                ihl = (data[0] & 0x0F) * 4
                if len(data) < ihl + 8:
                    n["errors"] += 1
                    continue
                spi = struct.unpack("!I", data[ihl:ihl + 4])[0]
                sa = state["in"].get(spi)
                if sa is None:
                    n["unknown_spi"] += 1
                    continue
                try:
                    inner = sa.decrypt(IP(data))
                except Exception:
                    n["auth_failed"] += 1
                    continue
                os.write(tun, bytes(inner))
                n["in"] += 1
        now = time.monotonic()
        if now - last >= 1.0:
            last = now
            print("esp-peer: " + " ".join(f"{k}={v}" for k, v in n.items()), flush=True)


if __name__ == "__main__":
    main()
