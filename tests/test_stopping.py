"""Stopping a run stops it: Ctrl-C (SIGINT to the launcher's process group, as a
terminal sends it), SIGTERM and SIGKILL to the launcher alone. Afterwards no process
of the job is left and the checkpoint root loads; a second job saving into the same
root while the first runs is refused, naming the owner."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from elastor_mcore import checkpoint
from tests.conftest import REPO, TINY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS_BEFORE_SIGNAL = 6
GONE_WITHIN_S = 60  # generous on a loaded 2-core machine; the figure is printed


def train_command(save_dir, steps=400) -> list[str]:
    return [sys.executable, "-m", "elastor_mcore.cli", "train", "--recipe", str(TINY),
            "--layout", "dp2-tp1-pp1", "--steps", str(steps), "--save", str(save_dir),
            "--save-interval", "2"]


def launch_command(run_dir) -> list[str]:
    return [sys.executable, "-m", "elastor_mcore.cli", "launch", "--recipe", str(TINY),
            "--hardware", str(REPO / "recipes" / "hardware" / "cpu-slots.yaml"),
            "--slots", "2", "--steps", "400", "--run-dir", str(run_dir),
            "--save-interval", "2"]


def start_job(command: list[str], log_path) -> subprocess.Popen:
    """The launcher in a process group of its own, as a shell runs a foreground job."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, log_path, step: int, line: str = "step {:5d}") -> None:
    deadline = time.monotonic() + 300
    while line.format(step) not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the run ended or stalled before step {step}:\n"
                        f"{log_path.read_text()[-4000:]}")
        time.sleep(0.2)


def job_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launcher, torchrun and the ranks (and whatever they started)."""
    launcher = psutil.Process(proc.pid)
    return [launcher, *launcher.children(recursive=True)]


def seconds_until_gone(processes: list[psutil.Process]) -> float:
    started = time.monotonic()
    while time.monotonic() - started < GONE_WITHIN_S:
        alive = [p for p in processes
                 if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return time.monotonic() - started
        time.sleep(0.1)
    pytest.fail(f"still running {GONE_WITHIN_S}s after the signal: "
                f"{[(p.pid, p.cmdline()[:4]) for p in alive]}")


def check_root_loads(save_dir) -> int:
    reader = checkpoint.open(save_dir)
    for info in reader.tensors():
        reader.read(info.name)  # every chunk's checksum
    return reader.manifest.step


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_signal_stops_the_whole_job(tmp_path, how):
    save_dir, log_path = tmp_path / "ckpt", tmp_path / "train.log"
    proc = start_job(train_command(save_dir), log_path)
    try:
        wait_for_step(proc, log_path, STEPS_BEFORE_SIGNAL)
        processes = job_processes(proc)
        assert len(processes) >= 4, processes  # launcher, torchrun, two ranks
        if how == "ctrl-c":
            second = subprocess.run(train_command(save_dir, steps=2), cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": str(REPO)},
                                    capture_output=True, text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            assert f"checkpoint root {save_dir} is in use by job" in second.stderr
            print(f"second writer refused: {second.stderr.strip()}")
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        gone_s = seconds_until_gone(processes)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    expected = {"ctrl-c": 130, "sigterm": 143, "sigkill": -signal.SIGKILL}[how]
    assert code == expected, log_path.read_text()[-3000:]
    step = check_root_loads(save_dir)
    assert step >= 2
    print(f"{how}: no process of the job left after {gone_s:.1f}s; step {step} loads")
    if how != "sigkill":
        last = log_path.read_text().strip().splitlines()[-1]
        assert f"the last committed checkpoint is step {step}" in last, last


def test_ctrl_c_stops_elastor_launch(tmp_path):
    """The supervisor forwards Ctrl-C to its launch and does not relaunch."""
    run_dir, log_path = tmp_path / "run", tmp_path / "launch.log"
    proc = start_job(launch_command(run_dir), log_path)
    try:
        wait_for_step(proc, log_path, STEPS_BEFORE_SIGNAL, line="step {:4d}/400")
        processes = job_processes(proc)
        os.killpg(proc.pid, signal.SIGINT)
        gone_s = seconds_until_gone(processes)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log_path.read_text()
    assert code == 130, output[-3000:]
    assert "launch 1" not in output  # stopped, not recovered
    step = check_root_loads(run_dir / "checkpoints")
    print(f"launch ctrl-c: no process of the job left after {gone_s:.1f}s; step {step} loads")
    assert f"stopped by SIGINT; the last committed checkpoint is step {step}" in output
