"""Multi-host tests: two hosts built from namespaces (tests/multihost/cluster.py), 2 ranks
each, reached by ``hvdliterun -H`` over ssh, MPI over TCP. Skipped, with the reason, where
the hosts cannot be built (not root, no iproute2 or sshd)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster, running_cluster
from mh_util import CLOCK_OFFSET_S


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("multihost"), n=2,
                         clock_offsets_s=(0, CLOCK_OFFSET_S)) as hosts:
        yield hosts


@pytest.fixture(scope="session")
def three_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three hosts (no clock offsets): elastic jobs that lose and gain a host, and jobs
    launched from a head node of their own (host 3) onto hosts 1 and 2."""
    with running_cluster(tmp_path_factory.mktemp("three-hosts"), n=3) as hosts:
        yield hosts
