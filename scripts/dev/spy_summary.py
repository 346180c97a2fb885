"""Sum a py-spy raw profile (``py-spy record --format raw``) per thread and frame.

    python scripts/dev/spy_summary.py spy.txt [TOP]

Prints, per thread, the frames with the most samples inclusive (the frame or its callees)
and exclusive (the frame itself), as counts and shares of the thread's samples.
"""

from __future__ import annotations

import collections
import re
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total: collections.Counter[str] = collections.Counter()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip()
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            frames = [re.sub(r"\(/[^)]*?/(hvdlite|scripts|tests)/", r"(\1/", f)
                      for f in stack.split(";")]
            thread, n = frames[0][:40], int(count)
            total[thread] += n
            for frame in set(frames[1:]):
                inclusive[thread][frame] += n
            own[thread][frames[-1]] += n
    for thread, n in total.most_common():
        print(f"== {thread}: {n} samples")
        for frame, k in inclusive[thread].most_common(top):
            print(f"  {k:7d} {100 * k / n:5.1f}%  {frame}")
        print("  -- own")
        for frame, k in own[thread].most_common(12):
            print(f"  {k:7d} {100 * k / n:5.1f}%  {frame}")


if __name__ == "__main__":
    main()
