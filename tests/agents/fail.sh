#!/bin/sh
# fail.sh: prints "boom" to stderr and exits 3.
echo boom >&2
exit 3
