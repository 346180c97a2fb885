"""The device transport policy (``ipc`` auto/always/off) for every kind of placement."""

from __future__ import annotations

import pytest

from hvdlite._gpu.placement import Placement, transport
from hvdlite.errors import BackendUnavailableError


def _where(*gpus: tuple[str, str, list[int]], peer: bool = True) -> Placement:
    table = {(host, bus): ranks for host, bus, ranks in gpus}
    one_host = len({host for host, _, _ in gpus}) == 1
    return Placement(table, one_host, peer and one_host)


SHARED = _where(("a", "0:1", [0, 1]))
SHARED_TWO_HOSTS = _where(("a", "0:1", [0, 1]), ("b", "0:1", [2, 3]))
PER_RANK = _where(("a", "0:1", [0]), ("a", "0:2", [1]))
PER_RANK_NO_PEER = _where(("a", "0:1", [0]), ("a", "0:2", [1]), peer=False)
TWO_HOSTS = _where(("a", "0:1", [0]), ("b", "0:1", [1]))


@pytest.mark.parametrize(("where", "mode", "max_bytes", "want"), [
    (SHARED, "auto", 0, "ipc"),
    (SHARED, "always", 0, "ipc"),
    (PER_RANK, "auto", 0, "nccl"),
    (PER_RANK, "auto", 65536, "mixed"),
    (PER_RANK, "always", 0, "ipc"),
    (PER_RANK, "off", 65536, "nccl"),
    (PER_RANK_NO_PEER, "always", 0, "nccl"),
    (PER_RANK_NO_PEER, "auto", 65536, "nccl"),
    (TWO_HOSTS, "always", 0, "nccl"),
    (TWO_HOSTS, "auto", 65536, "nccl"),
])
def test_transport_table(where: Placement, mode: str, max_bytes: int, want: str) -> None:
    assert transport(where, mode, max_bytes) == want


def test_shared_gpu_with_ipc_off_names_ranks_gpu_and_fix() -> None:
    with pytest.raises(BackendUnavailableError,
                       match=r"ranks \[0, 1\] on host a share one GPU \(0:1\).*ipc is off.*auto"):
        transport(SHARED, "off", 0)


def test_shared_gpu_across_hosts_cannot_be_joined() -> None:
    with pytest.raises(BackendUnavailableError, match=r"share one GPU.*spans hosts"):
        transport(SHARED_TWO_HOSTS, "auto", 0)


def test_describe_lists_every_gpu() -> None:
    assert SHARED_TWO_HOSTS.describe() == "a GPU 0:1: ranks [0, 1]; b GPU 0:1: ranks [2, 3]"
    assert [ranks for _, ranks in SHARED_TWO_HOSTS.shared] == [[0, 1], [2, 3]]
