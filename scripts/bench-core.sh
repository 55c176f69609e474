#!/bin/sh
# bench-core.sh [REV] [TASKS] [SECONDS]: the leader's decision core alone
# (tests/src/bin/bench-core.rs: N tasks due on the same second, no store,
# one thread) for this checkout and — side by side, in one run — for git
# revision REV (default 76c7e85, before the cron cache). The bench's source
# is copied into REV's worktree (target/bench-baseline/REV, its own target
# dir), so any revision whose core has the same public API can be measured.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
rev=${1:-76c7e85}
tasks=${2:-1000}
seconds=${3:-20}
cd "$root"
echo "building this checkout's bench-core (release) ..."
cargo build --quiet --release -p punchclock-tests --bin bench-core
out="$root/target/bench-baseline/$rev"
if [ ! -d "$out/src" ]; then
  mkdir -p "$out"
  git worktree add --detach "$out/src" "$rev" >/dev/null
fi
cp tests/src/bin/bench-core.rs "$out/src/tests/src/bin/bench-core.rs"
echo "building bench-core at $rev (release) in $out ..."
(cd "$out/src" && CARGO_TARGET_DIR="$out/target" cargo build --quiet --release -p punchclock-tests --bin bench-core)
# Alternating runs, three each: the figures of one machine state side by side.
for i in 1 2 3; do
  echo "== run $i: $rev"
  "$out/target/release/bench-core" "$tasks" "$seconds" | tail -n +2
  echo "== run $i: this checkout"
  target/release/bench-core "$tasks" "$seconds" | tail -n +2
done
