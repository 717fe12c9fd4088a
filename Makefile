# starfabric: build / test / demo entry points.
# `make test` and `make demo` work on a fresh Debian 12 machine with rustup stable:
# both first run scripts/setup.sh, which installs what is missing (and is quick
# when everything is there).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

CARGO ?= cargo
# Debian's python: it has python3-scapy. A pyenv/venv `python3` earlier on PATH may not.
PYTHON ?= /usr/bin/python3
FUZZ_SECONDS ?= 60
# Test binaries are built with the `ci` profile (Cargo.toml: release without LTO).
TEST_PROFILE ?= ci

# rustup installs cargo here; make sure it is found even from a non-login shell.
export PATH := $(if $(CARGO_HOME),$(CARGO_HOME),$(HOME)/.cargo)/bin:$(PATH)
export PYTHONDONTWRITEBYTECODE := 1

# The Kubernetes manifests' check (deploy/k8s, docs/deploy.md): the venv setup.sh makes
# and the binary whose command lines the manifests must parse with.
K8S_VENV ?= .venv-tools
K8S_BIN  ?= $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)/$(TEST_PROFILE)/starfabric

GOLDEN_GEN    := tests/golden/gen.py
GOLDEN_CORPUS := tests/golden/corpus.txt
NF_GOLDEN_GEN    := tests/golden/nf_gen.py
NF_GOLDEN_CORPUS := tests/golden/nf_corpus.txt

.PHONY: all setup build lint test test-elastic test-isolation golden golden-check k8s-check fuzz demo bench bench-gate clean

all: build

setup:
	bash scripts/setup.sh

build:
	$(CARGO) build --release --workspace

# Clippy and rustdoc check under the test profile, not dev: then the build scripts and
# proc macros they compile and run are the ones the test build reuses (docs/structure.md,
# "What CI builds"). No code differs: nothing in the workspace is cfg(debug_assertions).
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml -- --check
	$(CARGO) clippy --workspace --all-targets --profile $(TEST_PROFILE) -- -D warnings
	# Rustdoc too: a broken or private intra-doc link fails the lint.
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --workspace --no-deps --profile $(TEST_PROFILE)

# Sequential on purpose (also under -j): setup, lint, unit/integration tests, the
# Kubernetes manifests (with the binary those tests built), golden corpus freshness,
# then a bounded fuzz run.
test: setup
	$(MAKE) --no-print-directory lint
	$(CARGO) test --workspace --profile $(TEST_PROFILE)
	$(MAKE) --no-print-directory k8s-check
	# The end-to-end suite again with the XDP fast path on: every test's flows become
	# elephants after 50 packets in a window and run in the driver.
	SF_E2E_PP_ARGS="--offload --offload-packets 50" $(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_testbed
	# And on a PP node of two pipeline workers, AF_XDP on a veth of two queues
	# (docs/pp-pipeline.md, "Workers").
	SF_E2E_PP_ARGS="--workers 2" $(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_testbed
	$(MAKE) --no-print-directory test-elastic
	$(MAKE) --no-print-directory test-isolation
	$(MAKE) --no-print-directory golden-check
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

# Elasticity under live traffic (docs/elastic-tests.md): SC scale-out/in, a replica
# crash and an FM restart while new connections and iperf3 flows go through the PP
# node; then the PP cluster (docs/pp-cluster.md): PP scale-out/in and PP node failures
# measured with 0.5 ms probes. #[ignore]d in the workspace run above and run here one at a time: they look at
# connection setup while SC groups change, which parallel testbeds on 2 cores would blur.
test-elastic:
	$(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_elastic -- --ignored --test-threads=1 --nocapture
	$(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_pp_cluster -- --ignored --test-threads=1 --nocapture
	$(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_fabric -- --ignored --test-threads=1 --nocapture

# Tenant isolation at the PP node (docs/rate-isolation.md): a SYN flood (hping3) against
# another tenant's paced connections; #[ignore]d in the workspace run for the same reason
# as test-elastic (it times connection setup) and run here on its own.
test-isolation:
	$(CARGO) test --profile $(TEST_PROFILE) --workspace --test e2e_isolation -- --ignored --test-threads=1 --nocapture

# Every bench a goal in bench/goals.json names, once, then the goals table; fails when a
# goal is missed (needs root and the testbed's tools; takes ~10 minutes; CI does not run
# it). BENCH_GATE_ARGS: e.g. `--only setup,e2e`, `--from DIR` to check saved outputs.
bench-gate: build
	$(PYTHON) scripts/bench-gate.py --bin target/release/starfabric $(BENCH_GATE_ARGS)

# deploy/k8s against the Kubernetes API's schemas (strict), what the API server would
# refuse besides, every starfabric command line against the binary's own parser, and
# the bad manifests of deploy/k8s/testdata (each must be rejected). A few seconds. It
# checks the binary at K8S_BIN, which `make test` has just built; it builds one only
# when there is none.
k8s-check:
	@test -x $(K8S_VENV)/bin/python || { echo "k8s-check: $(K8S_VENV) is missing: run make setup" >&2; exit 1; }
	@test -x $(K8S_BIN) || $(CARGO) build --profile $(TEST_PROFILE) -p starfabric
	$(K8S_VENV)/bin/python scripts/k8s-check.py --bin $(K8S_BIN)

golden:
	tmp=$$(mktemp); trap 'rm -f "$$tmp"' EXIT; \
	$(PYTHON) $(GOLDEN_GEN) > "$$tmp"; \
	cp "$$tmp" $(GOLDEN_CORPUS); \
	$(PYTHON) $(GOLDEN_GEN) --hash-vectors > "$$tmp"; \
	cp "$$tmp" tests/golden/hash_vectors.txt; \
	$(PYTHON) $(NF_GOLDEN_GEN) > "$$tmp"; \
	cp "$$tmp" $(NF_GOLDEN_CORPUS); \
	echo "wrote $(GOLDEN_CORPUS) ($$(wc -l < $(GOLDEN_CORPUS)) lines), tests/golden/hash_vectors.txt and $(NF_GOLDEN_CORPUS)"

golden-check:
	@test -f $(GOLDEN_CORPUS) || { echo "$(GOLDEN_CORPUS) is missing: run make golden" >&2; exit 1; }
	tmp=$$(mktemp); trap 'rm -f "$$tmp"' EXIT; \
	$(PYTHON) $(GOLDEN_GEN) > "$$tmp"; \
	if ! diff -u $(GOLDEN_CORPUS) "$$tmp"; then \
		echo "corpus is stale: run make golden" >&2; exit 1; \
	fi; \
	$(PYTHON) $(GOLDEN_GEN) --hash-vectors > "$$tmp"; \
	if ! diff -u tests/golden/hash_vectors.txt "$$tmp"; then \
		echo "hash vectors are stale: run make golden" >&2; exit 1; \
	fi; \
	$(PYTHON) $(NF_GOLDEN_GEN) > "$$tmp"; \
	if ! diff -u $(NF_GOLDEN_CORPUS) "$$tmp"; then \
		echo "NF decision corpus is stale: run make golden" >&2; exit 1; \
	fi; \
	echo "golden corpus is up to date"

fuzz:
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

demo: setup
	$(CARGO) run --release -p starfabric -- demo

bench:
	$(CARGO) run --release -p starfabric -- bench pipeline
	$(CARGO) bench --workspace

# Keeps fuzz/artifacts (crash inputs are evidence, not build output).
clean:
	$(CARGO) clean
	rm -rf fuzz/target fuzz/coverage
