#!/usr/bin/env bash
# Bounded libFuzzer run of the fuzz targets in fuzz/ on STABLE Rust.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS (default 60) is the fuzzing time per target; TARGETs default to every
# target in fuzz/fuzz_targets/. Fails (exit 1) on a crash, printing the artifact path.
#
# Sanitizer (FUZZ_SANITIZER=auto|address|none, default auto): with a nightly toolchain
# installed (`rustup toolchain list` shows one), the targets build with
# AddressSanitizer (`cargo +nightly fuzz run --sanitizer address`), so an out-of-bounds
# read or a use-after-free in unsafe code (the AF_XDP rings, the XDP map views) or in a
# C dependency stops the run with a report, not only a panic. Without nightly, auto
# falls back to `--sanitizer none` on stable and says so: that build uses only stable
# codegen flags (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*,
# --cfg fuzzing, -Cdebug-assertions); only the sanitizers (-Zsanitizer=...) need
# nightly. No RUSTC_BOOTSTRAP is needed (and we avoid it: it makes build scripts that
# probe for nightly turn on unstable features).
#
# New inputs libFuzzer finds go to fuzz/target/corpus/<target>/ (git-ignored); the
# committed seeds in fuzz/corpus/<target>/ are read but not written.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

SECS="${1:-60}"
[[ "$SECS" =~ ^[0-9]+$ ]] && [ "$SECS" -gt 0 ] || { echo "usage: $0 [SECONDS] [TARGET...]" >&2; exit 2; }
shift || true

export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz not installed: run scripts/setup.sh (or make setup)" >&2
    exit 1
fi

if [ "$#" -gt 0 ]; then
    TARGETS=("$@")
else
    mapfile -t TARGETS < <(cd fuzz/fuzz_targets && ls -1 *.rs | sed 's/\.rs$//')
fi
[ "${#TARGETS[@]}" -gt 0 ] || { echo "fuzz: no targets in fuzz/fuzz_targets" >&2; exit 1; }

SAN="${FUZZ_SANITIZER:-auto}"
TOOLCHAIN=()
case "$SAN" in
    auto)
        if cargo +nightly --version >/dev/null 2>&1; then
            SAN=address
        else
            SAN=none
            echo "fuzz: no nightly toolchain: building without a sanitizer (stable)"
        fi ;;
    address|none) ;;
    *) echo "fuzz: FUZZ_SANITIZER must be auto, address or none (got $SAN)" >&2; exit 2 ;;
esac
if [ "$SAN" = address ]; then
    cargo +nightly --version >/dev/null 2>&1 \
        || { echo "fuzz: FUZZ_SANITIZER=address needs a nightly toolchain" >&2; exit 1; }
    TOOLCHAIN=(+nightly)
fi
echo "fuzz: sanitizer: $SAN (toolchain: ${TOOLCHAIN[*]:-default})"

status=0
for t in "${TARGETS[@]}"; do
    gen="fuzz/target/corpus/$t"
    seeds="fuzz/corpus/$t"
    arts="fuzz/artifacts/$t"
    log="fuzz/target/fuzz-$t.log"
    mkdir -p "$gen" "$seeds" "$arts"
    before="$(ls -1 "$arts")"

    echo "fuzz: $t: building and fuzzing for ${SECS}s (log: $log)"
    start=$SECONDS
    rc=0
    cargo "${TOOLCHAIN[@]}" fuzz run --sanitizer "$SAN" "$t" "$gen" "$seeds" -- \
        -max_total_time="$SECS" -timeout=10 -print_final_stats=1 >"$log" 2>&1 || rc=$?
    took=$((SECONDS - start))

    new="$(comm -13 <(printf '%s\n' "$before" | sort) <(ls -1 "$arts" | sort) | sed '/^$/d')"
    if [ "$rc" -eq 0 ] && [ -z "$new" ]; then
        # libFuzzer's last status line, e.g. "#123456 DONE cov: 210 ft: 800 corp: 90/4Kb exec/s: 4000 ..."
        last="$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)"
        execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
        echo "fuzz: $t: ok in ${took}s, ${execs:-?} execs, no crash; last: ${last:-?}"
        continue
    fi

    status=1
    echo "---- $log (panic message, then last lines) ----" >&2
    grep -m 1 -A 4 -E "panicked at|ERROR: (libFuzzer|AddressSanitizer)" "$log" >&2 || true
    echo "[...]" >&2
    tail -n 30 "$log" >&2
    echo "----" >&2
    if [ -n "$new" ]; then
        while IFS= read -r a; do
            echo "fuzz: $t: FAILED: crash artifact: $ROOT/$arts/$a" >&2
            echo "fuzz:   reproduce: cargo ${TOOLCHAIN[*]} fuzz run --sanitizer $SAN $t $arts/$a" >&2
        done <<<"$new"
    else
        echo "fuzz: $t: FAILED (exit $rc) without an artifact: build error? see $log" >&2
    fi
done

exit "$status"
