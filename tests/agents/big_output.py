"""big_output.py: a 1 MB result and 1 MB of binary noise on stdout and on
stderr, then exit 0 (issue 8: records that fit the store)."""
import json
import os

noise = bytes(range(256)) * 4096  # 1 MiB, every byte value
os.write(1, noise)
os.write(2, noise)
with open(os.environ["PUNCHCLOCK_RESULT_FILE"], "w") as f:
    json.dump({"data": "r" * 1_000_000}, f)
