"""`bench gpu --report` on CPU (`--random-init tiny`): the same code path as on a GPU, smoke-sized.
Checks that every figure the report promises is there and consistent; the numbers themselves are
CPU timings and mean nothing for a GPU. And the wall-clock budget (`--budget-s`): a section the
budget cannot fit is skipped and listed with its reason, the command still exits 0 and the report
is whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from ocrl.bench.budget import Budget

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
    assert data["skipped"] == {} and data["settings"]["budget_s"] == 450  # the default budget: everything ran


class _RunsOut(Budget):
    """A budget with plenty left for the first four sections (load, engine start, serve b1,
    serve b4) and nothing after: what a slow GPU would meet in the train section."""

    ran = 0

    def left(self) -> float:
        return 1000.0 if self.ran < 4 else 0.0

    async def run(self, name, work, **kw) -> bool:
        finished = await super().run(name, work, **kw)
        self.ran += 1
        return finished


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU box the real `bench gpu` runs instead of the CPU smoke")
def test_bench_gpu_skips_what_the_budget_cannot_fit_and_still_writes_the_report(tmp_path, monkeypatch):
    from ocrl import __main__ as cli
    from ocrl.bench import gpu

    monkeypatch.setattr(gpu, "Budget", _RunsOut)
    report = tmp_path / "gpu.json"
    argv = ["bench", "gpu", "--report", str(report), "--repeats", "1", "--threads", "1", "--rollout-batch-size", "4",
            "--record-dir", str(tmp_path / "run")]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # --threads 1 is this process's setting now: give it back
    data = json.loads(report.read_text())
    (arch,) = data["archs"].values()
    hf = arch["engines"]["hf"]
    assert set(hf["serve"]) == {"1", "4"} and "step_s" not in hf and "stall_s" not in hf  # measured before the budget ran out
    (train,) = [name for name in data["skipped"] if name.endswith("/hf/train")]
    assert data["skipped"][train].startswith("budget: 0 s of 450 left")
    (stall,) = [name for name in data["skipped"] if name.endswith("/hf/stall")]
    assert "needs the train section" in data["skipped"][stall]
    assert data["seconds"] >= 0 and data["gpu_tests"] == {"skipped": "no CUDA"}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_section_starts_only_when_what_is_left_covers_the_last_one_of_its_kind():
    clock, skipped, saves = FakeClock(), {}, []
    budget = Budget(10, skipped, spent=1, floor=2, clock=clock, save=lambda: saves.append(1))
    assert budget.left() == 9  # start-up counts
    assert budget.estimate("serve") == 2  # a kind not seen yet: the floor

    async def takes(seconds):
        clock.now += seconds

    assert await budget.run("a/serve b1", lambda: takes(5), kind="serve")
    assert budget.estimate("serve") == 5 and budget.left() == 4
    ran = []
    assert not await budget.run("a/serve b8", lambda: ran.append(1) or takes(5), kind="serve")  # 4 s left, ~5 needed
    assert ran == [] and skipped == {"a/serve b8": "budget: 4 s of 10 left, ~5 s needed"}
    assert await budget.run("a/train", lambda: takes(3), kind="train")  # a new kind needs the floor only
    assert len(saves) == 3  # the report is written after every section, skipped ones included


async def test_a_section_that_overruns_what_is_left_is_cut_and_says_so():
    skipped, finished = {}, []

    async def forever():
        await anyio.sleep(60)
        finished.append(1)

    budget = Budget(0.2, skipped, floor=0)
    assert not await budget.run("a/stall", forever, kind="stall")
    assert finished == [] and skipped["a/stall"].startswith("budget: cut after")
    assert "stall" not in budget.took  # a cut section is no estimate for the next one


def test_the_gpu_tests_run_from_the_repository_root(monkeypatch):
    """`bench gpu` runs `pytest tests/test_gpu.py` in a subprocess: from the checkout's root, where
    that path exists (it ran from ocrl/ once, where pytest finds no such file)."""
    from ocrl.bench import gpu

    ran = {}

    def run(cmd, **kwargs):
        ran.update(kwargs, cmd=cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="3 passed, 1 skipped in 9.0s", stderr="")

    monkeypatch.setattr(gpu.subprocess, "run", run)
    result = gpu.gpu_tests(timeout=60)
    assert Path(ran["cwd"]) == ROOT and (Path(ran["cwd"]) / ran["cmd"][-1]).is_file()
    assert (result["rc"], result["passed"], result["skipped"]) == (0, 3, 1)
