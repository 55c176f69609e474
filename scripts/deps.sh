#!/usr/bin/env bash
# make deps: install through apt (with sudo when not root) every Debian
# package that the build, `make demo` or a test uses and that is missing.
# Each package is checked by what is actually used from it, not by a
# command that happens to share its name: a package installed by hand on a
# development machine and missing on a new one broke the build once
# (issue 18). The build itself needs no system package beyond a Rust
# toolchain and a C compiler: the .proto files are compiled by protox.
#
#   scripts/deps.sh           install what is missing for `make test`
#   scripts/deps.sh --demo    only what `make demo` needs (python3)
#   scripts/deps.sh --check   list what is missing, exit 1 if anything is
#   scripts/deps.sh --bench   also what `make bench` needs to build older
#                             revisions side by side (protoc and its
#                             well-known types, from before protox)
set -u
check_only=0; bench=0; demo=0
for a in "$@"; do
  case "$a" in
    --check) check_only=1 ;;
    --bench) bench=1 ;;
    --demo) demo=1 ;;
    *) echo "usage: deps.sh [--check] [--demo | --bench]"; exit 2 ;;
  esac
done

# package | probe (a shell test of what the build, the demo or a test uses) | who uses it
need=(
  "python3|python3 -c 'import json, hmac, http.server'|the example agents, the demo's webhook receiver"
)
[ "$demo" = 1 ] || need+=(
  "openssl|openssl version|deploy/tls/make-certs.sh (auth and TLS tests)"
  "etcd-server|etcd --version|the cluster tests (real etcd processes)"
  "prometheus|prometheus --version && promtool --version|the metrics test (a real Prometheus, promtool check)"
  "faketime|test -r /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1|the clock-step test (libfaketime steps dev's wall clock)"
  "docker-compose|docker-compose version|the deploy files test (docker-compose config checks deploy/compose)"
  "python3-venv|python3 -m venv --help|the deploy files test (kubernetes-validate, from PyPI, in a venv)"
  "rabbitmq-server|test -x /usr/lib/rabbitmq/bin/rabbitmq-server && test -x /usr/lib/rabbitmq/bin/rabbitmqctl|the queue trigger tests (a real RabbitMQ node on free ports)"
  "nats-server|nats-server --version|the queue trigger tests (a real NATS server with JetStream)"
  "postgresql|ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1|the history archive tests (initdb and a real PostgreSQL server on a free port)"
  "chromium|test -x /usr/bin/chromium|the dashboard tests (a real headless browser)"
  "chromium-driver|test -x /usr/bin/chromedriver|the dashboard tests (WebDriver for chromium)"
)
if [ "$bench" = 1 ]; then
  need+=(
    "protobuf-compiler|protoc --version|make bench: building revisions older than protox"
    "libprotobuf-dev|test -r /usr/include/google/protobuf/timestamp.proto|make bench: protoc's well-known types"
  )
fi

# PyPI tools, each in a venv of its own under target/tools (they are not
# Debian packages): kubernetes-validate checks deploy/kubernetes against the
# Kubernetes schemas it ships (no cluster, no registry).
pypi=()
[ "$demo" = 1 ] || pypi=("kubernetes-validate==1.37.0|kubernetes-validate|the deploy files test (deploy/kubernetes manifests)")
root=$(cd "$(dirname "$0")/.." && pwd)
install_pypi() {
  for row in "${pypi[@]}"; do
    IFS='|' read -r spec cmd why <<<"$row"
    venv="$root/target/tools/$cmd"
    "$venv/bin/$cmd" --version >/dev/null 2>&1 && continue
    if [ "$check_only" = 1 ]; then echo "missing: $spec from PyPI ($why)"; return 1; fi
    echo "installing $spec from PyPI into $venv"
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "$spec" >/dev/null || { echo "cannot install $spec from PyPI ($why)"; return 1; }
  done
  return 0
}

missing=()
for row in "${need[@]}"; do
  IFS='|' read -r pkg probe why <<<"$row"
  if ! bash -c "$probe" >/dev/null 2>&1; then
    missing+=("$pkg")
    echo "missing: $pkg ($why)"
  fi
done
if [ ${#missing[@]} -eq 0 ]; then install_pypi; exit $?; fi
[ "$check_only" = 1 ] && exit 1
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq || exit 1
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || exit 1
# What was installed must now pass its probe, or the build would fail later
# with a worse message.
bad=0
for row in "${need[@]}"; do
  IFS='|' read -r pkg probe why <<<"$row"
  bash -c "$probe" >/dev/null 2>&1 || { echo "still missing after apt-get install: $pkg ($why): $probe"; bad=1; }
done
install_pypi || bad=1
exit $bad
