"""The benchmarks' target lines: which targets a run is judged by, at which rank count, against
which baseline. Synthetic statistics only (no GPU, no MPI job); no timing is asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS / "gpu")]

import bench_c6  # noqa: E402
import bench_g1  # noqa: E402
import bench_g2  # noqa: E402
import bench_g3  # noqa: E402
import summarize  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _st(median_us: float, p99_us: float | None = None) -> dict[str, float]:
    return {"median_s": median_us * 1e-6, "p99_s": (p99_us or 2 * median_us) * 1e-6}


def _g2_per(torch_plain_us: float, torch_sync_us: float) -> dict[str, Any]:
    per = {
        bench_g2.HVD_SYNC: _st(30, 50),
        bench_g2.HVD_WAIT: _st(20),
        bench_g2.RAW_SYNC: _st(20),
        bench_g2.TORCH_PLAIN: _st(torch_plain_us, 60),
        bench_g2.TORCH_SYNC: _st(torch_sync_us, 70),
        bench_g2.TORCH_WAIT: _st(25),
    }
    per["ratios"] = bench_g2.ratios(per)
    return per


def test_g2_one_rank_judges_against_raw_and_the_fastest_host_usable_torch_form() -> None:
    per = _g2_per(torch_plain_us=40, torch_sync_us=80)
    lines = {t["target"]: t for t in bench_g2.targets_at(1, 4, per)}
    assert per["ratios"]["torch fastest host-usable form"] == bench_g2.TORCH_PLAIN
    p50 = lines[f"G2 4 B sync p50 / torch fastest ({bench_g2.TORCH_PLAIN}) p50"]
    assert (p50["value"], p50["limit"], p50["met"]) == (0.75, 0.8, True)
    p99 = lines[f"G2 4 B sync p99 / torch fastest ({bench_g2.TORCH_PLAIN}) p99"]
    assert (p99["value"], p99["limit"], p99["met"]) == (0.833, 1.0, True)
    raw = lines[f"G2 4 B sync p50 / {bench_g2.RAW_SYNC} p50"]
    assert (raw["value"], raw["limit"], raw["met"]) == (1.5, 2.0, True)
    assert lines[f"G2 4 B {bench_g2.HVD_WAIT} p50"]["limit"] == 30.0


def test_g2_takes_the_async_torch_form_when_it_is_faster() -> None:
    per = _g2_per(torch_plain_us=80, torch_sync_us=50)
    assert per["ratios"]["torch fastest host-usable form"] == bench_g2.TORCH_SYNC
    assert per["ratios"]["hvdlite sync / torch fastest (p50)"] == 0.6


def test_g2_takes_a_baseline_timed_before_hvdlite_started_when_it_is_faster() -> None:
    per = _g2_per(torch_plain_us=40, torch_sync_us=80)
    per[bench_g2.TORCH_PLAIN + bench_g2.gl.ALONE] = _st(25, 40)
    per[bench_g2.RAW_SYNC + bench_g2.gl.ALONE] = _st(10)
    r = bench_g2.ratios(per)
    assert r["torch fastest host-usable form"] == bench_g2.TORCH_PLAIN + bench_g2.gl.ALONE
    assert r["hvdlite sync / torch fastest (p50)"] == 1.2
    assert r["hvdlite sync / raw NCCL + sync (p50)"] == 3.0


def test_g2_two_ranks_keep_the_absolute_targets() -> None:
    lines = bench_g2.targets_at(2, 4096, _g2_per(40, 80))
    assert [(t["target"].split(" ", 3)[-1], t["limit"]) for t in lines] == [
        (f"{bench_g2.HVD_SYNC} p50", 60.0),
        (f"{bench_g2.HVD_SYNC} p99", 150.0),
        (f"{bench_g2.HVD_WAIT} p50", 30.0),
    ]


def _g3_res(torch_async_ms: float, torch_plain_ms: float) -> dict[str, Any]:
    ms = {
        bench_g3.ASYNC: 2.0,
        bench_g3.GROUPED: 0.5,
        bench_g3.ASYNC_AC: 2.2,
        bench_g3.GROUPED_AC: 0.6,
        bench_g3.LIMIT: 0.2,
        bench_g3.LIMIT_AC: 0.2,
        bench_g3.RAW_PER: 1.0,
        bench_g3.TORCH_ASYNC: torch_async_ms,
        bench_g3.TORCH_PLAIN: torch_plain_ms,
    }
    return {k: _st(v * 1e3) for k, v in ms.items()}


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, [("grouped", 3.0), ("torch", 0.2)]),
        (2, [("grouped", 2.0), ("ms", 2.5), ("ms", 2.5), ("torch", 0.35)]),
    ],
)
def test_g3_targets_follow_the_rank_count(size: int, expected: list[tuple[str, float]]) -> None:
    res = _g3_res(torch_async_ms=10.0, torch_plain_ms=8.0)
    lines = bench_g3.summarise(res, 161, "resnet50", size)
    kinds = [
        ("grouped" if "grouped" in t["target"] else "torch" if "torch" in t["target"] else "ms",
         t["limit"])
        for t in lines
    ]
    assert kinds == expected
    assert res["ratios"]["torch fastest per-tensor form"] == bench_g3.TORCH_PLAIN
    assert lines[-1]["value"] == 0.25  # 2.0 ms against the faster torch form's 8.0 ms


def test_g6_targets_follow_the_rank_count() -> None:
    one = bench_g3.summarise(_g3_res(10.0, 8.0), 391, "bert_large", 1)
    assert [(t["value"], t["limit"]) for t in one] == [(2.5, 2.0), (10.0, 3.0)]
    two = bench_g3.summarise(_g3_res(10.0, 8.0), 391, "bert_large", 2)
    assert [(t["value"], t["limit"]) for t in two] == [(2.5, 1.3)]


def test_g1_targets_follow_the_rank_count() -> None:
    mib = 1 << 20
    assert [bench_g1.target_ratio(n, 1) for n in (4 * mib, 16 * mib, 64 * mib, 256 * mib)] == [
        None, 1.5, None, 1.05,
    ]
    assert [bench_g1.target_ratio(n, 2) for n in (4 * mib, 16 * mib, 256 * mib)] == [
        None, 1.03, 1.03,
    ]


def test_c6_floor_is_the_faster_two_hop_form() -> None:
    worst = {
        bench_c6.HVD: _st(6.0, 90),
        bench_c6.RAW: _st(2.0),
        bench_c6.FLOOR_QUEUE: _st(12.0),
        bench_c6.FLOOR_LOCKS: _st(10.0),
    }
    assert bench_c6.fastest_floor(worst) == bench_c6.FLOOR_LOCKS
    floor, raw, p99 = bench_c6.targets(worst)
    assert (floor["value"], floor["met"]) == (0.6, True)
    assert (raw["value"], raw["met"]) == (3.0, True)
    assert (p99["value"], p99["met"]) == (90.0, True)
    worst[bench_c6.FLOOR_QUEUE + bench_c6.ALONE] = _st(7.5)
    worst[bench_c6.RAW + bench_c6.ALONE] = _st(1.5)
    assert bench_c6.fastest_floor(worst) == bench_c6.FLOOR_QUEUE + bench_c6.ALONE
    floor, raw, _ = bench_c6.targets(worst)
    assert (floor["value"], floor["met"]) == (0.8, False)
    assert (raw["value"], raw["met"]) == (4.0, True)


def test_summarize_ends_with_every_target_and_counts_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "g5.json"
    good.write_text(json.dumps({
        "benchmark": "G5 completion chain",
        "meta": {"gpu": "X", "ranks": 1},
        "table": "(table)",
        "targets": [
            {"target": "G5 on / off", "value": 0.9, "limit": 0.7, "unit": "x", "met": False},
            {"target": "G5 other", "value": 1.0, "limit": 2.0, "unit": "x", "met": True},
        ],
    }))
    assert summarize.main([str(good), str(tmp_path / "g6.json")]) == 0
    tail = capsys.readouterr().out.rstrip().splitlines()[-5:]
    assert tail == [
        "== every target",
        "MISSED G5 on / off: 0.9x (limit 0.7x)",
        "met    G5 other: 1.0x (limit 2.0x)",
        "MISSED g6.json: MISSING (the benchmark did not finish; see the log above)",
        "targets: 1 met, 1 missed; result files missing or unreadable: 1",
    ]
