"""Multi-host tests: two hosts built from namespaces (tests/multihost/cluster.py), 2 ranks
each, reached by ``hvdliterun -H`` over ssh, MPI over TCP. Skipped, with the reason, where
the hosts cannot be built (not root, no iproute2 or sshd)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster, unavailable
from jobs_util import under_mpi_launcher
from mh_util import CLOCK_OFFSET_S


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = unavailable()
    if why is None and under_mpi_launcher():
        why = "multi-host tests start their own jobs; not inside an MPI job"
    if why is not None:
        pytest.skip(why)
    shared = tmp_path_factory.mktemp("multihost")
    hosts = Cluster(base=shared / "_hosts", shared=shared, n=2,
                    clock_offsets_s=(0, CLOCK_OFFSET_S))
    hosts.start()
    try:
        yield hosts
    finally:
        hosts.stop()
