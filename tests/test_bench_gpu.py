"""`bench gpu --report` on CPU (`--random-init tiny`): the same code path as on a GPU, smoke-sized.
Checks that every figure the report promises is there and consistent; the numbers themselves are
CPU timings and mean nothing for a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU box the real `bench gpu` runs instead of the CPU smoke")
def test_bench_gpu_report_on_cpu(tmp_path):
    report = tmp_path / "gpu.json"
    cmd = [sys.executable, "-m", "ocrl", "bench", "gpu", "--report", str(report), "--repeats", "1", "--threads", "1",
           "--rollout-batch-size", "4", "--record-dir", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NOT GPU figures" in done.stdout
    data = json.loads(report.read_text())
    assert data["environment"]["device"].startswith("CPU")
    assert data["gpu_tests"] == {"skipped": "no CUDA"}
    (arch,) = data["archs"].values()
    assert "SGLang" in arch["missing"]
    hf = arch["engines"]["hf"]
    assert set(hf["serve"]) == {"1", "4"}  # the CPU smoke's batch sizes
    for row in hf["serve"].values():
        assert row["tokens_per_s"] > 0 and row["bare_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["tokens_per_s"] / row["bare_tokens_per_s"])
    assert hf["verified"] is True and hf["swap_kind"] == "merged"
    assert hf["step_ratio"] == pytest.approx(hf["step_s"] / hf["bare_step_s"])
    assert hf["swap_ratio"] == pytest.approx(hf["swap_s"] / hf["forward_s"])
    assert hf["stall_ratio"] == pytest.approx(hf["stall_s"] / hf["decode_step_s"])
    assert hf["step_and_swap_wall_s"] > 0  # the stall was measured while a step and its swap ran
