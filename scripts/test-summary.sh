#!/usr/bin/env bash
# The closing line of `make test`: how many tests skipped, and which (each
# skip writes a line to target/test-skips.txt; under CI a skip fails unless
# its PUNCHCLOCK_SKIP_*_TESTS=1 allows it).
set -u
f="${CARGO_TARGET_DIR:-target}/test-skips.txt"
n=0
[ -s "$f" ] && n=$(wc -l < "$f")
if [ "$n" -eq 0 ]; then
  echo "make test: every test ran (0 skipped)"
else
  echo "make test: $n test(s) skipped:"
  sed 's/^/  /' "$f"
fi
