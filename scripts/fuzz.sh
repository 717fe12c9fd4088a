#!/usr/bin/env bash
# Bounded libFuzzer run of the fuzz targets in fuzz/ on STABLE Rust.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS (default 60) is the fuzzing time per target; TARGETs default to every
# target in fuzz/fuzz_targets/. Fails (exit 1) on a crash, printing the artifact path.
#
# How this works on stable: `cargo fuzz run --sanitizer none` builds with only stable
# codegen flags (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*,
# --cfg fuzzing, -Cdebug-assertions); only the sanitizers (-Zsanitizer=...) need
# nightly. No RUSTC_BOOTSTRAP is needed (and we avoid it: it makes build scripts
# that probe for nightly turn on unstable features).
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
    cargo fuzz run --sanitizer none "$t" "$gen" "$seeds" -- \
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
            echo "fuzz:   reproduce: cargo fuzz run --sanitizer none $t $arts/$a" >&2
        done <<<"$new"
    else
        echo "fuzz: $t: FAILED (exit $rc) without an artifact: build error? see $log" >&2
    fi
done

exit "$status"
