# punchclock — the two commands a new user runs:
#   make demo   build, start `punchclock dev` with the example agents and tasks, show runs
#   make test   the whole suite (make deps installs what it uses through apt if missing)

CARGO ?= cargo
BIN := target/debug/punchclock

.PHONY: all deps deps-demo deps-bench build test demo bench bench-idle bench-core bench-engine bench-load bench-chain bench-http peers-venv bench-events bench-spawn bench-apply bench-history bench-ui shim-static fmt clippy clean

all: build

# Debian packages the demo and the tests use (etcd, prometheus/promtool,
# openssl, python3, rabbitmq-server, nats-server), each checked by what is
# used from it and installed
# through apt when missing: scripts/deps.sh lists them. The build itself
# needs only a Rust toolchain and a C compiler.
deps:
	@./scripts/deps.sh

# What `make demo` needs beyond the build: python3 (the example agents and
# the demo's webhook receiver).
deps-demo:
	@./scripts/deps.sh --demo

# `make bench` also builds older revisions side by side, from before the
# build compiled its .proto files itself: they need protoc and its
# well-known types.
deps-bench:
	@./scripts/deps.sh --bench

build:
	$(CARGO) build --workspace --bins

# Skipped tests list themselves in target/test-skips.txt (under CI a skip
# fails unless its PUNCHCLOCK_SKIP_*_TESTS=1 allows it): the closing line
# counts them.
test: deps build
	@rm -f target/test-skips.txt
	$(CARGO) test --workspace --no-fail-fast
	$(MAKE) bench-idle
	@./scripts/test-summary.sh

demo: deps-demo build
	./scripts/demo.sh

# Benches that print figures (not part of `make test`): idle cost, engine
# transactions per run and throughput against the pre-issue-6 build.
bench: bench-idle bench-core bench-engine bench-load bench-chain bench-events bench-spawn bench-apply bench-history bench-ui

# Issue 35: run history at a million runs (`ARGS=N` for another count):
# listing pages p50/p99 and export runs/s on the embedded store beside the
# listing main answered before the issue, and on PostgreSQL (started here);
# the server's RSS while exporting; etcd's size after 100,000 runs without
# and with --history postgres:// (ARGS="RUNS ETCD_RUNS").
bench-history: deps
	$(CARGO) build --release -q -p punchclock
	PUNCHCLOCK_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/release/punchclock $(CARGO) run --release -q -p punchclock-tests --bin bench-history -- $(ARGS)

# Issue 36: the dashboard's server time (tasks page at 10,000 and 100,000
# tasks, a task page with 100,000 runs: p50/p99) and 100 live streams held
# for a minute under 300 runs a second (the server's RSS); ARGS="TASKS...".
bench-ui: deps
	$(CARGO) build --release -q -p punchclock
	PUNCHCLOCK_BIN=$${CARGO_TARGET_DIR:-$(CURDIR)/target}/release/punchclock $(CARGO) run --release -q -p punchclock-tests --bin bench-ui -- $(ARGS)

# Issue 22: the decision core alone (no store, one thread): CPU per run from
# a slot to its dispatch, and of the runner's reports, beside a revision.
bench-core:
	./scripts/bench-core.sh $(or $(REV),76c7e85) $(ARGS)

# Issue 6: store transactions per run and runs/s, embedded and etcd, before/after.
bench-engine: deps deps-bench build
	./scripts/bench-engine.sh

# Issue 7: load rows (N tasks every second, 10,000 on one second) on dev,
# server + runner and etcd, release builds, this checkout against a
# revision: `make bench-load REV=<git revision> ARGS="--targets dev"`.
REV ?= ebf31dc
bench-load: deps deps-bench
	./scripts/bench-load.sh $(REV) $(ARGS)

# Issue 8, acceptance 1: a 10,000- and 100,000-task file through the CLI
# on dev, 10,000 on a real etcd (release build).
# Issue 20: the admission chain's cost — 300 tasks every second that all
# declare a resource and are in a budget's scope (neither limits), beside
# the same load on the commit before resources and budgets (8d2f642).
bench-chain: deps deps-bench
	./scripts/bench-load.sh 8d2f642 --targets dev --rows 300 --chain $(ARGS)

# The load rows with an HTTP agent (issue 22: what the scheduler itself
# costs per run), beside the commit before HTTP agents with /bin/true and
# APScheduler 3 calling the same HTTP agent (tests/peers/, from the venv
# that peers-venv makes from PyPI; without it the bench says so and skips
# the peer rows).
bench-http: deps deps-bench peers-venv
	./scripts/bench-load.sh e75493f --agent http --targets dev,server --rows 1000,burst --window 60 $(ARGS)

# A Python venv with the peer schedulers the benches compare against.
PEERS_VENV := target/peers-venv
peers-venv:
	@$(PEERS_VENV)/bin/python -c 'import apscheduler' 2>/dev/null || \
	  { python3 -m venv $(PEERS_VENV) && $(PEERS_VENV)/bin/pip install -q 'apscheduler==3.10.4'; } || \
	  echo "peers-venv: could not install APScheduler from PyPI (the benches skip the peer rows)"

# Issue 21: events into runs on dev (release build): webhook request ->
# run committed p50/p99, and RabbitMQ messages at a fixed rate into runs
# (commit lag p50/p99, runs/s, loss): `make bench-events ARGS="--rate 2000"`.
bench-events: deps
	$(CARGO) build --quiet --release --workspace --bins
	./target/release/bench-events --bin $(CURDIR)/target/release/punchclock $(ARGS)

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
