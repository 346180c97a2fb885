"""A job that runs allreduces until it is ended from outside (a host killed or cut off).
Rank 0 creates ``MARKER`` once every rank has done 30 steps.

    hvdliterun ... -- python mh_forever.py MARKER
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import hvdlite as hvd

hvd.init()
marker = Path(sys.argv[1])
x = np.ones(4096, dtype=np.float32)
step = 0
while True:
    total = hvd.allreduce(x, name="step", op=hvd.Sum)
    assert total[0] == hvd.size()
    step += 1
    if step == 30 and hvd.rank() == 0:
        marker.write_text("running\n")
    time.sleep(0.005)
