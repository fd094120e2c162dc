"""Stopping without a world: the checkpoint root's lease (refusal, take-over, release)
and the commit wait's timeout."""

import json
import subprocess
import sys
import time

import pytest

from elastor_mcore.checkpoint.lease import LEASE_FILE, CheckpointLease, LeaseError

pytestmark = pytest.mark.timeout(60)


def test_second_job_is_refused_naming_the_owner(tmp_path):
    with CheckpointLease(tmp_path, "job-a"):
        with pytest.raises(LeaseError) as err:
            CheckpointLease(tmp_path, "job-b").acquire()
    message = str(err.value)
    assert "is in use by job job-a" in message and "--save DIR" in message
    assert not (tmp_path / LEASE_FILE).exists()  # released on exit


def test_same_job_retakes_its_lease(tmp_path):
    first = CheckpointLease(tmp_path, "job-a")
    first.acquire()
    second = CheckpointLease(tmp_path, "job-a")  # e.g. the supervisor's next launch
    second.acquire()
    assert second.read().job_id == "job-a"
    with pytest.raises(LeaseError):  # still held against other jobs
        CheckpointLease(tmp_path, "job-b").acquire()
    second.release()
    first.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_lease_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = {"job_id": "crashed", "host": __import__("socket").gethostname(), "pid": dead.pid,
             "pid_started": time.time() - 5, "started_at": time.time() - 5,
             "refreshed_at": time.time()}
    (tmp_path / LEASE_FILE).write_text(json.dumps(owner))
    with caplog.at_level("WARNING"), CheckpointLease(tmp_path, "job-b") as lease:
        assert lease.read().job_id == "job-b"
    assert "taking over the lease" in caplog.text and "job crashed" in caplog.text


LAUNCHER = """
import subprocess, sys, time
from elastor_mcore.checkpoint.lease import CheckpointLease
lease = CheckpointLease(sys.argv[1], "job-a")
lease.acquire()
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        start_new_session=True)
lease.refresh()  # as the supervisor does once torchrun has started
print(rank.pid, flush=True)
time.sleep(120)
"""


def test_lease_holds_until_the_last_process_the_launcher_started_is_gone(tmp_path):
    """A SIGKILLed launcher leaves processes it started that may still write (ranks
    stopping): the lease names them, and a new job is refused until they are gone."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    try:
        assert [pid for pid, _ in CheckpointLease(tmp_path, "x").read().writers] == [rank]
        with pytest.raises(LeaseError, match="is in use by job job-a"):
            CheckpointLease(tmp_path, "job-b").acquire()
    finally:
        subprocess.run(["kill", "-9", str(rank)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the orphan is reaped by init
        try:
            with CheckpointLease(tmp_path, "job-b") as lease:
                assert lease.read().job_id == "job-b"
            break
        except LeaseError:
            time.sleep(0.2)
    else:
        pytest.fail("the lease was not taken over once every process of job-a was gone")


def test_lease_not_refreshed_is_stale_on_any_host(tmp_path):
    owner = {"job_id": "remote", "host": "another-host", "pid": 1, "pid_started": 0.0,
             "started_at": time.time() - 600, "refreshed_at": time.time() - 120}
    (tmp_path / LEASE_FILE).write_text(json.dumps(owner))
    with CheckpointLease(tmp_path, "job-b", stale_after_s=60) as lease:
        assert lease.read().job_id == "job-b"


def test_live_remote_lease_is_refused_and_refresh_keeps_it_alive(tmp_path):
    with CheckpointLease(tmp_path, "job-a", stale_after_s=1.0, refresh_s=0.2) as lease:
        time.sleep(1.5)  # longer than stale_after_s: only refreshing keeps it
        assert time.time() - lease.read().refreshed_at < 1.0
        with pytest.raises(LeaseError):
            CheckpointLease(tmp_path, "job-b", stale_after_s=1.0, refresh_s=0.2).acquire()


def test_unreadable_lease_is_retaken(tmp_path):
    (tmp_path / LEASE_FILE).write_text("{")  # a crash mid-write
    with CheckpointLease(tmp_path, "job-b") as lease:
        assert lease.read().job_id == "job-b"


def test_commit_wait_for_a_dead_writer_ends_in_an_error(tmp_path):
    """A writer that died never leaves its marker: the coordinator's wait has a
    timeout derived from its own write time, with a floor, and names the rank."""
    from elastor_mcore.checkpoint import CheckpointError, SavePolicy
    from elastor_mcore.checkpoint.background import done_marker, wait_for_markers

    policy = SavePolicy(commit_timeout_floor_s=0.5, commit_timeout_factor=10)
    assert policy.commit_timeout_s(0.01) == 0.5 and policy.commit_timeout_s(2.0) == 20.0
    done_marker(tmp_path, 1).write_text("done\n")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[2\] did not finish writing"):
        wait_for_markers(tmp_path, [1, 2], policy.commit_timeout_s(0.01))
