"""Faults during asynchronous saves of real training runs (``elastor train``).

A worker is SIGKILLed from outside at chosen moments of a background save; torchrun
then tears the world down. Afterwards the previous committed step must load (every
chunk's checksum is verified by reading every tensor), the partial step must not be
listed, and the next ``--load`` start must delete the partial ``.tmp_`` directory.

Run 1 (saves every 2 steps) is killed in rank 0, the committer, as soon as the
temporary directory of step 4 appears. Run 2 resumes (saves every 3 steps) and is
killed in rank 0 once rank 1 has declared its part of step 6 durable, before the
commit. In both, rank 0 is frozen (SIGSTOP) the moment the step's temporary directory
appears, so its commit cannot win a race against the kill however fast the machine.
A third run saves onto a file system with room for one step only and, with
``--on-save-error continue``, trains to the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from elastor_mcore import checkpoint as ck
from tests.checkpoint_checks import small_tmpfs
from tests.conftest import REPO, TINY

STEPS = "8"
RANK_SCAN_S = 0.1
"""How often the ranks are looked for until both exist: a scan of the process tree
takes milliseconds of CPU, and the ranks exist seconds before any save."""
MOMENT_POLL_S = 0.002
"""How often the moment is checked once the ranks are known (a directory listing)."""


def worker_ranks(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """The training ranks under an ``elastor train`` process, by their RANK."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "elastor_mcore.elastic.rank.worker" in " ".join(child.cmdline()):
                found[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError):
            continue
    return found


def kill_when(args: list[str], log: Path, moment: Callable[[], bool], victim: int,
              before: Callable[[], None] = lambda: None,
              freeze: Callable[[], bool] = lambda: False, timeout: float = 600) -> None:
    """Start ``elastor train args``; the first time ``moment()`` holds, SIGKILL rank
    ``victim``; wait for the world to end. ``before`` is checked on every poll until
    then (it may assert). The first time ``freeze()`` holds, ``victim`` is stopped
    (SIGSTOP): it does nothing more until the kill, while the other ranks go on."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:  # cold ranks: found by their command line (worker_ranks)
        proc = subprocess.Popen([sys.executable, "-m", "elastor_mcore.cli", "train",
                                 "--no-zygote", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    ranks: dict[int, psutil.Process] = {}
    frozen = False
    deadline = time.monotonic() + timeout
    try:
        while True:
            if len(ranks) < 2:
                ranks = worker_ranks(proc)
            before()
            if not frozen and victim in ranks and freeze():
                ranks[victim].suspend()
                frozen = True
            if moment():
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run ended or stalled before the kill:\n{log.read_text()[-4000:]}")
            time.sleep(MOMENT_POLL_S if len(ranks) == 2 else RANK_SCAN_S)
        ranks[victim].kill()
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


def partial(root: Path, step: int) -> Path | None:
    """The temporary directory of an uncommitted save of ``step`` (``.tmp_step_N.<token>``)."""
    return next(root.glob(f".tmp_step_{step:08d}.*"), None)


def assert_loads(root: Path, step: int) -> None:
    reader = ck.open(root)
    assert reader.manifest.step == step
    for info in reader.tensors():
        reader.read(info.name)  # raises on any checksum mismatch


@pytest.mark.timeout(1500)
def test_killed_saves_leave_the_previous_step_and_are_cleaned(tmp_path):
    root = tmp_path / "ckpt"
    common = ["--recipe", str(TINY), "--layout", "dp2-tp1-pp1", "--steps", STEPS,
              "--save", str(root)]

    def step4_begun() -> bool:
        return partial(root, 4) is not None

    kill_when(common + ["--save-interval", "2"], tmp_path / "run1.log",
              moment=step4_begun, victim=0, freeze=step4_begun)
    tmp4 = partial(root, 4)
    assert ck.committed_steps(root) == [2] and tmp4 is not None
    assert_loads(root, 2)

    def stale_removed_at_start() -> None:
        if partial(root, 3) is not None:
            assert not tmp4.exists(), "the restarted run did not remove the partial save"

    def rank1_durable() -> bool:
        tmp6 = partial(root, 6)
        return tmp6 is not None and (tmp6 / "done.rank1").exists()

    kill_when(common + ["--save-interval", "3", "--load", str(root)],
              tmp_path / "run2.log", moment=rank1_durable, victim=0,
              before=stale_removed_at_start, freeze=lambda: partial(root, 6) is not None)
    committed = ck.committed_steps(root)
    assert 3 in committed and 6 not in committed
    assert partial(root, 6) is not None and ck.latest_step(root) == 3
    assert_loads(root, 3)


@pytest.mark.timeout(900)
def test_full_disk_with_continue_trains_to_the_end(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with small_tmpfs(root, "10M") as why_not:  # one tiny-llama step takes ~7 MB
        if why_not:
            pytest.skip(why_not)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = subprocess.run(
            [sys.executable, "-m", "elastor_mcore.cli", "train", "--recipe", str(TINY),
             "--layout", "dp2-tp1-pp1", "--steps", "6", "--save", str(root),
             "--save-interval", "2", "--on-save-error", "continue"],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=800)
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-4000:]
        assert "step     6" in output
        assert "No space left on device" in output and "Training continues" in output
        assert ck.committed_steps(root) == [2]
        assert not any(p.name.startswith(".tmp_") for p in root.iterdir())
        assert_loads(root, 2)
