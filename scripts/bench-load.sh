#!/bin/sh
# bench-load.sh [REV]: the load rows of issue 7 (N tasks every second,
# 10,000 on one second) on dev, server + runner (embedded) and etcd, for
# this checkout's release build and — side by side, in one run — for the
# release build of git revision REV (default: the engine before issue 6).
# REV is built in target/bench-baseline/REV (a worktree and its own target
# dir; a few minutes the first time). More arguments go to the bench
# binary, e.g. `scripts/bench-load.sh ebf31dc --targets dev --rows 1000`.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-ebf31dc}
[ $# -gt 0 ] && shift
cd "$root"
echo "building this checkout (release) ..."
cargo build --quiet --release --workspace --bins
make --no-print-directory shim-static
before=""
if git cat-file -e "$rev^{commit}" 2>/dev/null; then
  out="$root/target/bench-baseline/$rev"
  if [ ! -d "$out/src" ]; then
    mkdir -p "$out"
    git worktree add --detach "$out/src" "$rev" >/dev/null
  fi
  echo "building $rev (release) in $out ..."
  (cd "$out/src" && CARGO_TARGET_DIR="$out/target" cargo build --quiet --release --bins)
  before="--before $out/target/release/punchclock"
else
  echo "revision $rev is not in this clone's history; measuring this build only"
fi
# shellcheck disable=SC2086
exec cargo run --quiet --release -p punchclock-tests --bin bench-load -- --after "$root/target/release/punchclock" $before "$@"
