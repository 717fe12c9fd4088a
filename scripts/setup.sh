#!/usr/bin/env bash
# Install everything `make test` / `make demo` need on a fresh Debian 12 machine
# that already has rustup + stable Rust. Idempotent: checks before installing, and
# runs `apt-get update` only when some apt package is actually missing.
set -euo pipefail

die() { echo "setup: ERROR: $*" >&2; exit 1; }
step() { echo "setup: $*"; }

APT_PACKAGES=(
    clang llvm lld linux-libc-dev   # linux-libc-dev: <linux/bpf.h> for crates/xdp/bpf
    python3-scapy
    # The IPsec remote site's userspace ESP endpoint (crates/testbed/src/esp_peer.py,
    # for kernels without ESP): scapy's AES-GCM is python3-cryptography's.
    python3-cryptography
    iproute2 ethtool
    pkg-config m4 libelf-dev zlib1g-dev
    # xsk-rs (the AF_XDP backend, crates/pp) builds libxdp from source through
    # libxdp-sys: xdp-tools' configure needs m4 and refuses to run without pcap
    # headers; bindgen needs libclang (clang's libclang1 is enough).
    libpcap-dev
    protobuf-compiler make
    g++   # libfuzzer-sys compiles libFuzzer's C++ sources
    # The store crate's tests start their own /usr/bin/etcd on random loopback
    # ports with a temp data dir; etcdctl (etcd-client) is for debugging.
    etcd-server etcd-client
    # The netns testbed and its end-to-end tests (crates/testbed): real traffic tools.
    # Their packaged daemons (nginx, stun-server) are not used: the tests start their
    # own instances inside namespaces (see policy-rc.d below).
    iperf3 nginx-light wrk curl netcat-openbsd stun-client stun-server
    nftables netsniff-ng
    # The isolation scenario's SYN flood (crates/testbed/src/isolation.rs).
    hping3
    # Profiling the data path (docs/pp-pipeline.md, "TCP limit"): perf record/report.
    linux-perf
    # `make k8s-check`: its Python tools go into a venv of Debian's python (below).
    python3-venv
    # The dashboard's browser test (crates/itests/tests/cross_plane/ui_browser.rs): headless
    # chromium driven over WebDriver by chromedriver.
    chromium chromium-driver
    # `starfabric trace --pcap`'s e2e test reads the pcapng file back with tshark
    # (wireshark-common's debconf question is preseeded below).
    tshark
)

# ---- apt packages -----------------------------------------------------------
is_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = "installed" ]
}

missing=()
for p in "${APT_PACKAGES[@]}"; do
    is_installed "$p" || missing+=("$p")
done

if [ "${#missing[@]}" -eq 0 ]; then
    step "apt packages: all ${#APT_PACKAGES[@]} present"
else
    command -v apt-get >/dev/null || die "apt-get not found (need Debian/Ubuntu) to install: ${missing[*]}"
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "not root and no sudo: cannot install ${missing[*]}"
        SUDO=(sudo)
    fi
    step "apt packages: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # etcd-server, nginx, iperf3 and stun-server ship init scripts that invoke-rc.d
    # would start: a system etcd on 127.0.0.1:2379 (whose failed start fails the
    # install) and daemons in the host namespace on :80, :5201, :3478. Nothing here
    # uses them: the store tests start their own etcd, the testbed its own nginx,
    # iperf3 and STUN servers inside its namespaces. A policy-rc.d answering 101
    # ("action forbidden") keeps them stopped during the install; one already present
    # (container images ship one) is left as it is.
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\n# starfabric setup.sh: no service starts during install\nexit 101\n' \
            | "${SUDO[@]}" tee "$policy" >/dev/null
        "${SUDO[@]}" chmod 755 "$policy"
        trap '"${SUDO[@]}" rm -f "$policy"' EXIT
    fi
    # wireshark-common (tshark's) asks whether non-root users may capture; answer no
    # beforehand, so the install never waits on a question.
    echo "wireshark-common wireshark-common/install-setuid boolean false" \
        | "${SUDO[@]}" debconf-set-selections
    log="$(mktemp -t starfabric-setup-apt.XXXXXX)"
    if ! "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=300 update -qq >"$log" 2>&1; then
        tail -n 30 "$log" >&2; die "apt-get update failed (log: $log)"
    fi
    if ! "${SUDO[@]}" apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
        tail -n 30 "$log" >&2; die "apt-get install failed for: ${missing[*]} (log: $log)"
    fi
    rm -f "$log"
    for p in "${missing[@]}"; do
        is_installed "$p" || die "package $p still not installed after apt-get install"
    done
fi

# The golden generator needs Debian's python (the one with python3-scapy), not a
# pyenv/venv python3 that may come first on PATH.
/usr/bin/python3 -c 'import scapy' 2>/dev/null \
    || die "/usr/bin/python3 cannot import scapy (python3-scapy broken?)"
step "python: /usr/bin/python3 has scapy"

# ---- make k8s-check's Python tools ------------------------------------------
# kubernetes-validate (the Kubernetes API's JSON schemas) and its dependencies, pinned
# in scripts/requirements-k8s.txt, in a venv of Debian's python under the work tree
# (.venv-tools/, ignored by git): nothing goes into the system python. Reinstalled
# when the requirements file changes (a copy of it in the venv is the stamp).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-tools"
REQ="$ROOT/scripts/requirements-k8s.txt"
if [ -x "$VENV/bin/python" ] && cmp -s "$REQ" "$VENV/requirements-k8s.txt" \
    && "$VENV/bin/python" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
    step "k8s tools: present ($VENV: $("$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | awk '$1 == "kubernetes-validate" {print $1 " " $2}'))"
else
    step "k8s tools: installing into $VENV (pip install -r scripts/requirements-k8s.txt; about a minute)"
    if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
        rm -rf "$VENV"
        /usr/bin/python3 -m venv "$VENV" || die "python3 -m venv $VENV failed (python3-venv missing?)"
    fi
    log="$(mktemp -t starfabric-setup-pip.XXXXXX)"
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check --no-input -q -r "$REQ" >"$log" 2>&1; then
        tail -n 30 "$log" >&2; die "pip install -r $REQ failed (log: $log)"
    fi
    rm -f "$log"
    "$VENV/bin/python" -c 'import kubernetes_validate, jsonschema, yaml' \
        || die "$VENV still cannot import kubernetes_validate after the install"
    cp "$REQ" "$VENV/requirements-k8s.txt"
fi

# ---- Rust toolchain ---------------------------------------------------------
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
command -v cargo >/dev/null || die "cargo not found: install rustup + stable Rust first"
command -v rustc >/dev/null || die "rustc not found: install rustup + stable Rust first"
step "rust: $(rustc --version)"

for comp in rustfmt clippy; do
    case "$comp" in
        rustfmt) probe=(cargo fmt --version) ;;
        clippy)  probe=(cargo clippy --version) ;;
    esac
    if "${probe[@]}" >/dev/null 2>&1; then
        step "rust component $comp: present"
    else
        command -v rustup >/dev/null || die "$comp missing and rustup not found"
        step "rust component $comp: installing"
        rustup component add "$comp" >/dev/null 2>&1 \
            || die "rustup component add $comp failed (offline?)"
        "${probe[@]}" >/dev/null 2>&1 || die "$comp still not usable after install"
    fi
done

# cargo-fuzz is not installed: scripts/fuzz.sh builds and runs the fuzz targets with
# cargo and libFuzzer's own arguments (libfuzzer-sys builds libFuzzer with g++, above).

step "done"
