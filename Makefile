# punchclock — the two commands a new user runs:
#   make demo   build, start `punchclock dev` with the example agents and tasks, show runs
#   make test   the whole suite (installs protoc and etcd through apt if missing)

CARGO ?= cargo
BIN := target/debug/punchclock

.PHONY: all deps build test demo bench bench-idle bench-engine bench-load bench-spawn bench-apply shim-static fmt clippy clean

all: build

# System packages the build and tests need: protoc (tonic codegen), etcd
# (HA tests), python3 (example agents), prometheus and promtool (the
# metrics test). Installed through apt when missing.
deps:
	@missing=""; \
	command -v protoc >/dev/null 2>&1 || missing="$$missing protobuf-compiler"; \
	command -v etcd >/dev/null 2>&1 || missing="$$missing etcd-server"; \
	command -v python3 >/dev/null 2>&1 || missing="$$missing python3"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v openssl >/dev/null 2>&1 || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" -ne 0 ] && SUDO="sudo"; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

build: deps
	$(CARGO) build --workspace --bins

test: build
	$(CARGO) test --workspace
	$(MAKE) bench-idle

demo: build
	./scripts/demo.sh

# Benches that print figures (not part of `make test`): idle cost, engine
# transactions per run and throughput against the pre-issue-6 build.
bench: bench-idle bench-engine bench-load bench-spawn bench-apply

# Issue 6: store transactions per run and runs/s, embedded and etcd, before/after.
bench-engine: build
	./scripts/bench-engine.sh

# Issue 7: load rows (N tasks every second, 10,000 on one second) on dev,
# server + runner and etcd, release builds, this checkout against a
# revision: `make bench-load REV=<git revision> ARGS="--targets dev"`.
REV ?= ebf31dc
bench-load: deps
	./scripts/bench-load.sh $(REV) $(ARGS)

# Issue 8, acceptance 1: a 10,000- and 100,000-task file through the CLI
# on dev, 10,000 on a real etcd (release build).
bench-apply: deps
	$(CARGO) build --quiet --release --workspace --bins
	PUNCHCLOCK_BIN=$(CURDIR)/target/release/punchclock ./target/release/bench-apply $(ARGS)

# Issue 7, acceptance 4: CPU per agent start (/bin/true, 10,000 runs) with
# the punchclock-agent-shim binary, the __agent-shim subcommand, no shim.
bench-spawn: deps
	$(CARGO) build --quiet --release --workspace --bins
	$(MAKE) --no-print-directory shim-static
	./target/release/bench-spawn 10000 8

# The agent shim linked statically (no dynamic loader, no libgcc_s: about
# 0.2 ms less CPU per agent start), in target/release beside punchclock,
# where the runner looks for it. Its own target dir, so the workspace's
# fingerprints are untouched.
shim-static:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --quiet --release -p punchclock-agent-shim --target-dir target/static-shim
	install -D -m 755 target/static-shim/release/punchclock-agent-shim target/release/punchclock-agent-shim

# Acceptance 4 of issue 2: idle CPU and memory with 10,000 cron tasks (prints figures).
# The binary `build` made (not `cargo run -p`, whose per-package feature
# set would rebuild the workspace's crates for it, and again for the next
# `make demo`).
bench-idle: build
	./target/debug/bench-idle 10000 20

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --workspace --all-targets

clean:
	$(CARGO) clean
