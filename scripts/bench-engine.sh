#!/bin/sh
# bench-engine.sh: store transactions per run and runs/s for 1,000 runs,
# through the embedded store and a real etcd, for this build and — side by
# side, in one run — the build before the engine became a decision core
# (issue 6). The baseline is built from git history into
# target/bench-baseline/ (a worktree and its own target dir: ~3 minutes the
# first time). Extra arguments go to the bench binary (e.g. --runs 2000).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
base=${PUNCHCLOCK_BENCH_BASE:-ebf31dc}
out="$root/target/bench-baseline"
before=""
if git -C "$root" cat-file -e "$base^{commit}" 2>/dev/null; then
  if [ ! -d "$out/src" ]; then
    mkdir -p "$out"
    git -C "$root" worktree add --detach "$out/src" "$base" >/dev/null
  fi
  echo "building the baseline ($base) in $out ..."
  (cd "$out/src" && CARGO_TARGET_DIR="$out/target" cargo build --quiet --bins)
  before="--before $out/target/debug/punchclock"
else
  echo "baseline $base is not in this clone's history; measuring this build only"
fi
cd "$root"
# shellcheck disable=SC2086
exec cargo run --quiet -p punchclock-tests --bin bench-engine -- $before "$@"
