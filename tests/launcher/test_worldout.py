"""An elastic world's stderr (hvdlite/launcher/worldout.py) through a real pipe: MPICH Hydra's
teardown lines are held back, then dropped or printed; everything else passes at once."""

from __future__ import annotations

import os
import tempfile
import time

from hvdlite.launcher.worldout import NoiseFilter

# As MPICH 5.0.2's Hydra printed them after an elastic kill-reset (one host) and after a host
# was killed under a head node's mpiexec.
HYDRA = [
    b"[proxy:1@vm] HYD_pmcd_pmip_control_cmd_cb (/mpich-5.0.2/src/pm/hydra/proxy/pmip_cb.c:490): "
    b"assert (!closed) failed",
    b"[proxy:1@vm] HYDT_dmxu_poll_wait_for_event (/mpich-5.0.2/src/pm/hydra/lib/tools/demux/"
    b"demux_poll.c:76): callback returned error status",
    b"[proxy:1@vm] main (/mpich-5.0.2/src/pm/hydra/proxy/pmip.c:123): demux engine error "
    b"waiting for event",
    b"[mpiexec@vm] HYDT_bscu_wait_for_completion (/mpich-5.0.2/src/pm/hydra/lib/tools/bootstrap/"
    b"utils/bscu_wait.c:109): one of the processes terminated badly; aborting",
    b"[mpiexec@vm] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager "
    b"error waiting for completion",
    b"Connection to hv6453n2 closed by remote host.",
    # Two processes' lines interleaved (Hydra writes a tag and its message apart): once in CI.
    b"[proxy:1@vm] [mpiexec@vm] HYDT_bscu_wait_for_completion (/mpich-5.0.2/src/pm/hydra/lib/"
    b"tools/bootstrap/utils/bscu_wait.c:109): one of the processes terminated badly; aborting",
    b"HYD_pmcd_pmip_control_cmd_cb (/mpich-5.0.2/src/pm/hydra/proxy/pmip_cb.c:490): assert "
    b"(!closed) failed",
    b"[proxy:0@vm] ",
    # A proxy writing to an mpiexec already gone (CI, an elastic all-ranks failure).
    b"[proxy:0@vm] HYDU_sock_write (/mpich-5.0.2/src/pm/hydra/lib/utils/sock.c:250): write "
    b"error (Broken pipe)",
]
RANK = [b"Traceback (most recent call last):", b"[rank 1] ValueError: a rank's own line",
        b"[mpiexec@vm] main (mpiexec.c:1): some other error", b"",
        b"main (train.py:3): one of the processes is slow"]


def _through(keep: bool) -> tuple[bytes, bytes]:
    """Everything through a NoiseFilter; (what the sink got before finish, after finish)."""
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as sink, os.fdopen(read_fd, "rb") as source:
        noise = NoiseFilter(source, sink)
        lines = [HYDRA[0], RANK[0], *HYDRA[1:3], RANK[1], *HYDRA[3:], *RANK[2:]]
        os.write(write_fd, b"\n".join(lines) + b"\npartial progress")
        os.close(write_fd)
        noise.thread.join(5)
        time.sleep(0.05)
        sink.seek(0)
        before = sink.read()
        noise.finish(keep)
        sink.seek(0)
        return before, sink.read()


def test_teardown_lines_are_dropped_for_a_world_ended_on_purpose() -> None:
    before, after = _through(keep=False)
    assert before == after == b"\n".join(RANK) + b"\npartial progress"


def test_teardown_lines_are_printed_when_the_driver_cannot_say_why() -> None:
    before, after = _through(keep=True)
    assert before == b"\n".join(RANK) + b"\npartial progress"
    assert after == before + b"".join(line + b"\n" for line in HYDRA)
