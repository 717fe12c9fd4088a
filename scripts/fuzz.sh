#!/usr/bin/env bash
# Bounded libFuzzer run of the fuzz targets in fuzz/ on STABLE Rust.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS (default 60) is the fuzzing time per target; TARGETs default to every
# target in fuzz/fuzz_targets/. Fails (exit 1) on a crash, printing the artifact path.
#
# It builds and runs the targets as `cargo fuzz run` does (cargo-fuzz 0.13's flags), with
# cargo and the target binaries directly: one `cargo build` of all the targets, then each
# binary with libFuzzer's arguments. cargo-fuzz itself is not needed (its install cost a
# new machine a minute of CI); `cargo fuzz run TARGET` in fuzz/ still works for anyone
# who has it. The flags: -Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*
# (inline 8-bit counters, PC table, trace-compares, stack depth), --cfg fuzzing,
# -Cdebug-assertions, no branch folding, one codegen unit, release with line tables.
# (Sixteen codegen units built no faster here: 417 s either way from an empty target
# directory on 2 CPUs; docs/structure.md, "What CI builds".)
#
# Sanitizer (FUZZ_SANITIZER=auto|address|none, default auto): with a nightly toolchain
# installed (`rustup toolchain list` shows one), the targets build with
# AddressSanitizer (-Zsanitizer=address), so an out-of-bounds read or a use-after-free
# in unsafe code (the AF_XDP rings, the XDP map views) or in a C dependency stops the run
# with a report, not only a panic. Without nightly, auto falls back to no sanitizer on
# stable and says so: that build uses only stable codegen flags; only the sanitizers
# need nightly. No RUSTC_BOOTSTRAP is needed (and we avoid it: it makes build scripts
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

if [ "$#" -gt 0 ]; then
    TARGETS=("$@")
else
    mapfile -t TARGETS < <(cd fuzz/fuzz_targets && ls -1 *.rs | sed 's/\.rs$//')
fi
[ "${#TARGETS[@]}" -gt 0 ] || { echo "fuzz: no targets in fuzz/fuzz_targets" >&2; exit 1; }
for t in "${TARGETS[@]}"; do
    [ -f "fuzz/fuzz_targets/$t.rs" ] || { echo "fuzz: no target $t in fuzz/fuzz_targets" >&2; exit 2; }
done

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

# --target makes RUSTFLAGS apply to the targets and their dependencies, not to build
# scripts and proc macros (which must run uninstrumented).
TRIPLE="$(rustc "${TOOLCHAIN[@]}" -vV | sed -n 's/^host: //p')"
[ -n "$TRIPLE" ] || { echo "fuzz: cannot tell the host triple from rustc -vV" >&2; exit 1; }
FLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-pc-table"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-trace-compares"
FLAGS+=" --cfg fuzzing -Cllvm-args=-simplifycfg-branch-fold-threshold=0"
FLAGS+=" -Cllvm-args=-sanitizer-coverage-stack-depth -Cdebug-assertions"
FLAGS+=" -Ccodegen-units=1"
if [ "$SAN" = address ]; then
    FLAGS+=" -Zsanitizer=address"
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_odr_violation=0"
fi
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/fuzz/target}"
BINS=()
for t in "${TARGETS[@]}"; do BINS+=(--bin "$t"); done

mkdir -p fuzz/target
build_log="fuzz/target/fuzz-build.log"
echo "fuzz: building ${TARGETS[*]} (log: $build_log)"
start=$SECONDS
if ! RUSTFLAGS="$FLAGS ${RUSTFLAGS:-}" cargo "${TOOLCHAIN[@]}" build \
        --manifest-path fuzz/Cargo.toml --target "$TRIPLE" --release \
        --config 'profile.release.debug="line-tables-only"' \
        --target-dir "$TARGET_DIR" "${BINS[@]}" >"$build_log" 2>&1; then
    tail -n 40 "$build_log" >&2
    echo "fuzz: FAILED: the targets did not build (log: $build_log)" >&2
    exit 1
fi
echo "fuzz: built in $((SECONDS - start))s"

status=0
for t in "${TARGETS[@]}"; do
    gen="fuzz/target/corpus/$t"
    seeds="fuzz/corpus/$t"
    arts="fuzz/artifacts/$t"
    log="fuzz/target/fuzz-$t.log"
    mkdir -p "$gen" "$seeds" "$arts"
    before="$(ls -1 "$arts")"

    echo "fuzz: $t: fuzzing for ${SECS}s (log: $log)"
    start=$SECONDS
    rc=0
    "$TARGET_DIR/$TRIPLE/release/$t" -artifact_prefix="$ROOT/$arts/" \
        -max_total_time="$SECS" -timeout=10 -print_final_stats=1 "$gen" "$seeds" \
        >"$log" 2>&1 || rc=$?
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
            echo "fuzz:   reproduce: $TARGET_DIR/$TRIPLE/release/$t $arts/$a" >&2
        done <<<"$new"
    else
        echo "fuzz: $t: FAILED (exit $rc) without an artifact: see $log" >&2
    fi
done

exit "$status"
