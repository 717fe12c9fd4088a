#!/usr/bin/python3
"""Known-answer ESP packets from an independent implementation: scapy's
scapy.layers.ipsec (AES-GCM through the `cryptography` package, i.e. OpenSSL).

Prints the VECTORS of crates/ipsec/src/esp.rs (keymat, spi, seq, esn, inner packet,
ESP packet with its outer IPv4 header). Run with Debian's python3 (python3-scapy).
"""
from scapy.all import IP, TCP, UDP, Raw
from scapy.layers.ipsec import SecurityAssociation, ESP


def vector(keymat, spi, seq, esn, inner):
    hi, lo = seq >> 32, seq & 0xFFFFFFFF
    sa = SecurityAssociation(ESP, spi=spi, crypt_algo="AES-GCM", crypt_key=bytes.fromhex(keymat),
                             auth_algo="NULL", esn_en=esn, esn=hi,
                             tunnel_header=IP(src="198.18.1.2", dst="198.18.20.2"))
    e = sa.encrypt(inner, seq_num=lo, iv=seq.to_bytes(8, "big"))
    wire = bytes(e)
    assert bytes(sa.decrypt(IP(wire))) == bytes(inner)
    print("        Vector {")
    print(f'            keymat: "{keymat}",')
    print(f"            spi: {spi:#x},")
    print(f"            seq: {seq:#x},")
    print(f"            esn: {'true' if esn else 'false'},")
    print(f'            inner: "{bytes(inner).hex()}",')
    print(f'            esp_packet: "{wire.hex()}",')
    print("        },")


vector("000102030405060708090a0b0c0d0e0fa0a1a2a3", 0x1000, 7, False,
       IP(src="198.19.1.2", dst="198.18.170.10", id=1, ttl=64) / UDP(sport=1234, dport=5678) / Raw(b"hello, esp"))
vector("11" * 32 + "b0b1b2b3", 0xc0ffee01, 123456, False,
       IP(src="198.19.1.2", dst="198.18.170.10", id=2, ttl=63, flags="DF")
       / TCP(sport=40000, dport=80, flags="PA", seq=1000, ack=2000) / Raw(bytes(range(97))))
vector("2b7e151628aed2a6abf7158809cf4f3c01020304", 0x2000, (3 << 32) | 5, True,
       IP(src="198.18.170.10", dst="198.19.1.2", id=3) / UDP(sport=53, dport=33333) / Raw(b"x" * 13))
