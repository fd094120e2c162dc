"""Ranks start from a pre-imported worker (``elastic/rank/zygote.py``) through their
keeper (``elastic/rank/keeper.py``): real processes, a module of the test's own. The
rank finds torch imported, gets the keeper's argv, environment, directory and output,
and its exit code or signal comes back as the keeper's (an in-place keeper hides a
signal); a keeper killed takes its rank with it; without the zygote the keeper forks
the rank itself.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastor_mcore.elastic.prestart import prestarted
from elastor_mcore.elastic.protocol import ZYGOTE_ENV
from elastor_mcore.elastic.rank.keeper import exit_code
from tests.conftest import REPO

RANK = """
import concurrent.futures, multiprocessing, os, sys, time
if __name__ == "__main__":  # not in a multiprocessing child, which imports this module
    print("rank", os.getpid(), sys.argv[1:], os.environ.get("WHO"), os.getcwd(),
          "torch" in sys.modules, "xml.dom.minidom" in sys.modules, flush=True)
    if sys.argv[1] in ("child", "child-stays"):  # a (daemon) child of its own, then exit
        child = multiprocessing.get_context("spawn").Process(target=time.sleep,
                                                             args=(600,), daemon=True)
        child.start()
        open(sys.argv[2], "w").write(f"{os.getpid()} {child.pid}")
    if sys.argv[1] in ("pid", "child-stays"):
        if sys.argv[1] == "pid":
            open(sys.argv[2], "w").write(str(os.getpid()))
        time.sleep(60)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), 9)
    if sys.argv[1] == "logging":  # configures logging as a fresh interpreter lets it
        import logging
        logging.basicConfig(level=logging.INFO, format="logged: %(message)s")
        logging.getLogger("probe").info("an info line")
    if sys.argv[1] == "pool":  # left running: its idle workers end at exit
        concurrent.futures.ThreadPoolExecutor(2).submit(time.sleep, 0.1).result()
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def keeper(tmp: Path, env: dict, *args: str, wait: bool = True):
    (tmp / "probe_rank.py").write_text(RANK)
    env = {**os.environ, **env, "WHO": "keeper",
           "PYTHONPATH": f"{tmp}{os.pathsep}{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "elastor_mcore.elastic.rank.keeper", *args]
    if not wait:
        return subprocess.Popen(command, env=env, cwd=tmp, stdout=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def zygote():
    """A zygote that also pre-imports a workload's modules, one of which is missing."""
    with prestarted(True, imports=("xml.dom.minidom", "elastor_no_such_module")) as env:
        yield env


def test_a_rank_from_the_zygote_finds_torch_imported(zygote, tmp_path):
    result = keeper(tmp_path, zygote, "probe_rank", "3", "x")
    assert result.returncode == 3, result.stderr
    # torch and the workload's module imported before; the missing one did not stop it
    assert f"['3', 'x'] keeper {tmp_path} True True" in result.stdout
    started = time.perf_counter()
    assert keeper(tmp_path, zygote, "probe_rank", "0").returncode == 0
    print(f"a keeper and its rank from the zygote, start to exit: "
          f"{time.perf_counter() - started:.2f}s")


def test_a_rank_configures_logging_as_a_fresh_interpreter_would(zygote, tmp_path):
    """The zygote's own logging set-up (a root handler at WARNING) is not the rank's:
    ``logging.basicConfig`` in the rank takes effect, as Megatron-LM's does."""
    for env in (zygote, {}):  # from the zygote, and forked by the keeper itself
        result = keeper(tmp_path, env, "probe_rank", "logging")
        assert result.returncode == 0, result.stderr
        assert result.stderr.splitlines() == ["logged: an info line"], (env, result.stderr)


def test_a_signal_is_the_keepers_code_unless_in_place(zygote, tmp_path):
    assert keeper(tmp_path, zygote, "probe_rank", "signal").returncode == 128 + 9
    assert keeper(tmp_path, zygote, "--in-place", "probe_rank", "signal").returncode == 0
    assert keeper(tmp_path, zygote, "--in-place", "probe_rank", "4").returncode == 4


def written_pids(pid_file: Path, proc: subprocess.Popen) -> list[int]:
    """The pids the rank writes to ``pid_file`` once it is running."""
    deadline = time.monotonic() + 120
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return [int(pid) for pid in pid_file.read_text().split()]


def assert_gone(pid: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_keeper_takes_its_rank_along(zygote, tmp_path):
    pid_file = tmp_path / "rank.pid"
    proc = keeper(tmp_path, zygote, "probe_rank", "pid", str(pid_file), wait=False)
    [rank] = written_pids(pid_file, proc)
    assert os.getpgid(rank) == rank  # a session of its own: stopping it stops no other
    proc.kill()
    proc.wait()
    assert_gone(rank, "the rank outlived its keeper")


def test_a_ranks_own_children_end_with_it(zygote, tmp_path):
    """A rank that started a daemon multiprocessing child (as Megatron's checkpointing
    does) and returns ends it as a ``python -m`` process's exit would, so no orphan
    holds the keeper's output (torchrun's, the launcher's) open; a killed keeper's rank
    takes its children along; a thread pool left running does not keep a rank from
    ending (its idle workers are told to stop before threads are joined)."""
    assert keeper(tmp_path, zygote, "probe_rank", "pool").returncode == 0
    pid_file = tmp_path / "rank.pid"
    proc = keeper(tmp_path, zygote, "probe_rank", "child", str(pid_file), wait=False)
    _, child = written_pids(pid_file, proc)
    proc.communicate(timeout=60)  # the output closes: nothing outlived the rank
    assert proc.returncode == 0
    assert_gone(child, "the rank's child outlived it")
    pid_file.unlink()
    proc = keeper(tmp_path, zygote, "probe_rank", "child-stays", str(pid_file), wait=False)
    rank, child = written_pids(pid_file, proc)
    proc.kill()
    proc.wait()
    assert_gone(rank, "the rank outlived its keeper")
    assert_gone(child, "the rank's child outlived its keeper")


def test_without_a_zygote_the_keeper_forks_the_rank(tmp_path):
    assert ZYGOTE_ENV not in os.environ
    result = keeper(tmp_path, {}, "probe_rank", "5")
    assert result.returncode == 5 and f"['5'] keeper {tmp_path} False" in result.stdout


def test_exit_codes():
    assert exit_code(0, in_place=False) == 0
    assert exit_code(signal.SIGKILL, in_place=False) == 128 + signal.SIGKILL
    assert exit_code(signal.SIGKILL, in_place=True) == 0
    assert exit_code(3 << 8, in_place=True) == 3
