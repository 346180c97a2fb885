"""scripts/gpu/scaling.py: issue 41's per-GPU table from bench_t1 JSON files at several rank
counts. Synthetic files only (no GPU, no MPI job); the ratios are computed from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

import scaling  # noqa: E402

CAPTURED = "captured: hvdlite step (make_graphed_step)"


def _write(tmp: Path, model: str, ranks: int, ips: dict[str, float]) -> str:
    path = tmp / f"{model}_np{ranks}.json"
    path.write_text(json.dumps({
        "meta": {"ranks": ranks, "args": {"model": model}, "git_commit": "abc1234"},
        "results": {"training": {k: {"images_per_s_per_gpu": v} for k, v in ips.items()}}}))
    return str(path)


def test_per_gpu_figures_against_one_and_two_gpus(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files = [_write(tmp_path, "resnet50", n, {CAPTURED: v, "plain": 1000.0})
             for n, v in ((1, 2000.0), (2, 1900.0), (4, 1805.0))]
    assert scaling.main(files) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {CAPTURED}"))
    # 4 GPUs: 1805 / 2000 = 0.9025 of one GPU, 1805 / 1900 = 0.95 of two
    assert "1900 (0.950x 1)" in row and "1805 (0.902x 1, 0.950x 2)" in row, row
    assert "== resnet50" in out and "1, 2, 4 ranks" in out


def test_missing_and_duplicate_files_are_named(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    one = _write(tmp_path, "gpt2", 2, {"plain": 200.0})
    dup = tmp_path / "copy.json"
    dup.write_text(Path(one).read_text())
    assert scaling.main([one, str(dup), str(tmp_path / "gone.json")]) == 1
    out = capsys.readouterr().out
    assert "gone.json: MISSING" in out and "a second gpt2 file at 2 ranks" in out
