"""The supervisor: plan a layout for the live slots, run it under torchrun, watch it,
and on a failure stop it, find the survivors, re-plan and relaunch from the latest
committed checkpoint, until the run finishes or recovery is impossible. What the ranks
run is the config's ``Workload`` (the project's trainer, or Megatron-LM's
``pretrain_gpt.py``); everything here is the same for both.

Torchrun does the rendezvous and the process management of each launch; a launch ends
when a rank exits non-zero (torchrun then tears the others down and exits non-zero)
or when a rank stops heart-beating past its hang timeout (``heartbeat.HangPolicy``;
a hung collective: nothing exits, so the supervisor stops the job itself). A launch
whose ranks could not load the latest committed step (they report ``load_failed``)
makes the next one resume from the committed step before it. The global batch and the
data order do not depend on the layout, so the relaunched run continues the same loss
curve.

A workload whose ranks recover in place (``Workload.in_place``: the trainer unless
``--recovery relaunch``) keeps its launch through a rank's death or an injected hang:
the survivors re-plan in their processes (``elastic.inplace``), and a relaunch is the
fallback when that fails. A workload's ranks start from a pre-imported worker when it
allows it (``Workload.prestarted``, ``elastic.prestart``) unless ``--no-zygote``.

Run directory::

    checkpoints/            committed steps (step_<N>/, latest), unless the checkpoint
                            root is elsewhere (``--checkpoint-dir``: a directory or an
                            ``s3://BUCKET/PREFIX`` URL; ``JobConfig.checkpoint_dir``)
    hardware-profile.yaml   the profile measured for this run (``elastic.profiling``),
                            when the supervisor had to measure one
    launch<K>/              layout.yaml (torchrun ranks), plan.json (physical slots),
                            metrics.jsonl, torchrun.log, events.jsonl, heartbeat/
    timeline.json           launches and recoveries (``timeline``)
    zygote.log              the pre-imported worker's output (``elastic.prestart``)

The planner plans with a profile measured on this machine for the recipe when one
exists (the cached one above, or ``--hardware`` itself), measures one first when
asked (``--measure-profile``), and says which it used; each launch's end compares the
planner's predicted step time with the measured median.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from elastor_mcore import planner
from elastor_mcore.checkpoint.lease import CheckpointLease, new_job_id
from elastor_mcore.elastic import inplace, prestart, probe, profiling
from elastor_mcore.elastic.job import JobConfig, Launch, latest_readable, renumbered
from elastor_mcore.elastic.heartbeat import Timeout
from elastor_mcore.elastic.protocol import HEARTBEAT_DIR, Beat, read_beats
from elastor_mcore.elastic.report import launch_step_s, read_metrics
from elastor_mcore.elastic.timeline import LaunchRecord, recoveries, write_json
from elastor_mcore.elastic.torchrun import (forwarding_stop_signals, start_torchrun,
                                            torchrun_command)
from elastor_mcore.parallel.layout import Layout

log = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
"""After forwarding SIGINT/SIGTERM, how long torchrun may take to stop its ranks
before the supervisor SIGKILLs what is left."""


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig(JobConfig):
    """A job on the slots of one host; the supervisor sets each launch's layout,
    checkpoint and elastic paths."""

    hardware: planner.HardwareProfile
    """``launch.hardware`` loaded. A profile measured here for the recipe replaces it
    (see the module docstring)."""
    slots: tuple[int, ...]
    """Physical slots of the cluster (GPU ids, or CPU rank slots), node-major."""

    @property
    def failure_slots(self) -> Sequence[int]:
        return self.slots


@dataclass
class Outcome:
    finished: bool
    reason: str
    """Why the run ended, in a sentence for people."""
    launches: list[LaunchRecord] = field(default_factory=list)
    stopped_by: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped the run, if one did."""


def stop_job(proc: subprocess.Popen, worker_pids: Sequence[int]) -> None:
    """SIGKILL torchrun and every worker with its children. Torchrun starts each worker
    in a new session, so the job is several process groups: torchrun's, and one per
    worker (its id is the worker's pid, and outlives a worker that already died)."""
    groups = {proc.pid, *worker_pids}
    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                groups.add(os.getpgid(child.pid))
            except ProcessLookupError:
                pass
    except psutil.NoSuchProcess:
        pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def process_running(pid: int) -> bool:
    """Whether ``pid`` is alive (a zombie has exited, its parent has not reaped it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Supervisor:
    """Runs ``config`` to the end, recovering from failures; see the module docstring.

    ``on_message`` receives a line per event for people (launch, failure, recovery);
    ``on_step`` each step's metrics record (``elastic.rank.worker.MetricsPrinter``'s
    JSON) with the launch it came from.
    """

    def __init__(self, config: SupervisorConfig,
                 on_message: Callable[[str], None] = log.info,
                 on_step: Callable[[LaunchRecord, dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.on_message = on_message
        self.on_step = on_step
        self.launches: list[LaunchRecord] = []
        self.dead: set[int] = set()
        self.unreadable: set[int] = set()
        """Committed steps a launch failed to load: later launches resume from earlier
        ones (until a launch saves that step again)."""
        self.lease: CheckpointLease | None = None
        self.hardware = config.hardware
        """The profile the planner uses (chosen at the start of ``run``)."""
        self.profile_path: Path = config.hardware_path
        self.prestart_env: dict[str, str] = {}
        """Points the keepers to the pre-imported worker (``elastic.prestart``)."""

    # ----- the loop ------------------------------------------------------------------
    def run(self) -> Outcome:
        """Run to the end; the launches are one job, holding the checkpoint root's lease
        throughout (``checkpoint.lease.LeaseError`` before anything starts if another
        job holds it)."""
        cfg = self.config
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        with CheckpointLease(cfg.checkpoint_dir, new_job_id()) as self.lease, \
                prestart.prestarted(cfg.launch.zygote and cfg.workload.prestarted,
                                    cfg.run_dir / "zygote.log",
                                    imports=cfg.workload.zygote_imports) as self.prestart_env:
            self._choose_profile()
            return self._run()

    def _choose_profile(self) -> None:
        cfg = self.config
        choice = profiling.choose_profile(
            cfg.run_dir, cfg.workload.recipe_file, cfg.recipe, cfg.hardware_path,
            cfg.launch.devices, cfg.launch.measure_profile,
            on_line=lambda line: self.on_message(line.strip()))
        self.hardware = choice.hardware
        self.profile_path = choice.path
        self.on_message(f"planner profile: {choice.path} ({choice.why})")

    def _run(self) -> Outcome:
        cfg = self.config
        alive, probe_s = list(cfg.slots), 0.0
        try:
            while True:
                record = self._plan_and_launch(alive, probe_s)
                if isinstance(record, str):
                    return self._finish(False, record)
                if record.outcome == "stopped":
                    name = signal.Signals(record.stopped_by).name
                    return Outcome(False, f"stopped by {name} at launch {record.index}",
                                   self.launches, stopped_by=record.stopped_by)
                if record.outcome == "finished":
                    return self._finish(True, f"finished {cfg.workload.steps} steps after "
                                              f"{len(recoveries(self.launches))} recoveries")
                self._note_loads(record)
                restarts = len(self.launches) - 1
                if restarts >= cfg.launch.max_restarts:
                    return self._finish(False, f"gave up: launch {record.index} failed "
                                               f"and {restarts} restarts were made already "
                                               f"(--max-restarts {cfg.launch.max_restarts})")
                start = time.perf_counter()
                alive = self._survivors(alive, record)
                probe_s = time.perf_counter() - start
                self.on_message(f"survivors: {len(alive)} slots {alive} "
                                f"(probed in {probe_s:.2f}s)")
        finally:
            write_json(cfg.run_dir / "timeline.json", self.launches)

    def _finish(self, finished: bool, reason: str) -> Outcome:
        log.info(reason)
        return Outcome(finished, reason, self.launches)

    def _plan_and_launch(self, alive: list[int], probe_s: float) -> LaunchRecord | str:
        """Plan for ``alive``, run one launch to its end; a reason string if nothing
        can run on ``alive``."""
        cfg = self.config
        start = time.perf_counter()
        try:
            chosen = cfg.workload.plan(cfg.recipe, self.hardware, alive,
                                       use_all=cfg.launch.use_all_slots)
        except planner.PlannerError as exc:
            which = "surviving slots" if self.launches else "slots"
            return f"gave up: the {len(alive)} {which} {alive} cannot hold the model: {exc}"
        plan_s = time.perf_counter() - start
        committed = cfg.workload.committed_steps(cfg.checkpoint_dir)
        resume = latest_readable(committed, self.unreadable)
        if committed and resume is None:
            return (f"gave up: no committed step in {cfg.checkpoint_dir} loads (steps "
                    f"{committed} failed); training from scratch would overwrite them")
        index = len(self.launches)
        record = LaunchRecord(
            index=index, dir=str(cfg.run_dir / f"launch{index}"), alive=list(alive),
            slots=list(cfg.workload.rank_order(chosen.layout)),
            layout=chosen.layout.to_dict(), describe=chosen.layout.describe(),
            predicted_step_s=chosen.step_s, probe_s=probe_s, plan_s=plan_s, launched_at=0.0,
            resumed_from=resume)
        self.launches.append(record)
        shutil.rmtree(record.dir, ignore_errors=True)  # a rerun in the same run directory
        Path(record.dir).mkdir(parents=True)
        (Path(record.dir) / "plan.json").write_text(json.dumps(chosen.to_dict(), indent=2))
        resumed = ("from scratch" if record.resumed_from is None
                   else f"from step {record.resumed_from}")
        self.on_message(f"launch {index}: {len(record.slots)} slots {record.slots}, "
                        f"{record.describe} (planned in {plan_s:.2f}s), {resumed}")
        proc = self._start(record, chosen.layout)
        if self.lease is not None:
            self.lease.refresh()  # names torchrun: the lease holds until it is gone
        try:
            with forwarding_stop_signals(proc) as received:
                self._watch(record, proc, received)
                if received:  # torchrun got the signal too: let it stop its ranks
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=STOP_GRACE_S)
        finally:
            if proc.poll() is None or record.outcome != "finished":
                start = time.perf_counter()
                stop_job(proc, [b.pid for b in read_beats(self._heartbeats(record)).values()])
                record.stop_s = time.perf_counter() - start
            record.ended_at = time.time()
        measured = launch_step_s(record)
        if measured is not None:
            self.on_message(f"launch {index}: step time {measured:.3f}s measured (median), "
                            f"{record.predicted_step_s:.3f}s predicted by the planner "
                            f"({measured / record.predicted_step_s - 1:+.0%})")
        return record

    # ----- one launch ----------------------------------------------------------------
    def _start(self, record: LaunchRecord, layout: Layout) -> subprocess.Popen:
        cfg = self.config
        out = Path(record.dir)
        slots = tuple(record.slots)
        (out / "layout.yaml").write_text(renumbered(layout, slots).to_yaml())
        rank = cfg.workload.launch_command(Launch(
            directory=str(out), layout=str(out / "layout.yaml"), slots=slots,
            checkpoint_dir=str(cfg.checkpoint_dir), load_step=record.resumed_from,
            hardware=str(self.profile_path), use_all_slots=cfg.launch.use_all_slots))
        if cfg.workload.prestarted:  # under a keeper, from the pre-imported worker
            rank = prestart.keeper_command(rank, cfg.workload.in_place)
        env = dict(self.prestart_env)
        if cfg.launch.devices == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        with open(out / "torchrun.log", "w") as log_file:
            record.launched_at = time.time()
            return start_torchrun(torchrun_command(len(slots), rank.module, rank.args), env=env,
                                  stdout=log_file, stderr=subprocess.STDOUT)

    def _heartbeats(self, record: LaunchRecord) -> Path:
        return Path(record.dir) / HEARTBEAT_DIR

    def _watch(self, record: LaunchRecord, proc: subprocess.Popen,
               stop_signals: list[int]) -> None:
        """Until the launch ends: finished, a rank exited non-zero, a rank went silent,
        or a stop signal arrived (``stop_signals``, filled by the signal handler)."""
        cfg = self.config
        metrics = Path(record.dir) / "metrics.jsonl"
        seen = 0
        watch = inplace.InPlaceWatch(record, cfg.workload.steps, self.on_message) \
            if cfg.workload.in_place else None

        def silent_of(slots: list[int], beats: dict[int, Beat]) -> dict[int, Timeout]:
            return cfg.hang.silent_slots(slots, beats, record.launched_at, time.time(),
                                         cfg.workload.steps)

        while True:
            code = proc.poll()
            seen = self._forward_steps(record, metrics, seen)
            if stop_signals:
                record.outcome, record.stopped_by = "stopped", stop_signals[0]
                break
            if code is not None:
                record.exit_code = code
                record.outcome = "finished" if code == 0 else "exit"
                break
            beats = read_beats(self._heartbeats(record))
            if watch:  # failures the survivors recover from in place
                beats = watch.absorb(beats, lambda b: silent_of(watch.slots, b),
                                     process_running)
            died = [b.slot for b in beats.values()
                    if b.step < cfg.workload.steps and not process_running(b.pid)]
            if died:  # faster than waiting for torchrun to notice and tear down
                record.outcome, record.died_slots = "exit", died
                break
            silent = silent_of(watch.slots if watch else record.slots, beats)
            if silent:
                record.outcome, record.silent_slots = "hang", sorted(silent)
                record.hang_timeout = silent[record.silent_slots[0]].rule
                break
            time.sleep(cfg.poll_s)
        record.detected_at = time.time()
        if record.outcome in ("finished", "stopped"):
            return
        if record.outcome == "hang":
            what = (f"no heartbeat from slots {record.silent_slots} within the timeout "
                    f"({record.hang_timeout}): a hung rank or collective")
        elif record.died_slots:
            what = (f"the rank processes of slots {record.died_slots} are gone (once one "
                    f"fails, torchrun stops the others; output in {record.dir}/torchrun.log)")
        else:
            what = (f"torchrun exited with code {code} (a rank failed; its output is in "
                    f"{record.dir}/torchrun.log)")
        injected = record.failures()
        if injected:
            what += "; injected: " + ", ".join(
                f"{e['kind']} of slot {e['slot']} at step {e['step']}" for e in injected)
        self.on_message(f"launch {record.index} failed: {what}")

    def _forward_steps(self, record: LaunchRecord, metrics: Path, seen: int) -> int:
        """Pass the metrics lines written since the last call to ``on_step``."""
        if not metrics.is_file():
            return seen
        text = metrics.read_text()
        complete = text[:text.rfind("\n") + 1].splitlines()  # a line being written waits
        for line in complete[seen:]:
            if self.on_step:
                self.on_step(record, json.loads(line))
        return max(seen, len(complete))

    def _note_loads(self, launch: LaunchRecord) -> None:
        """After a launch: a step it failed to load is unreadable (the next launch
        resumes from the committed one before); steps it trained past were saved
        again."""
        ran = [m["step"] for m in read_metrics(Path(launch.dir) / "metrics.jsonl")]
        if ran:
            saved_again = range((launch.resumed_from or 0) + 1, max(ran))
            self.unreadable.difference_update(saved_again)
        failed = launch.events("load_failed")
        if failed and launch.resumed_from is not None:
            self.unreadable.add(launch.resumed_from)
            before = latest_readable(
                self.config.workload.committed_steps(self.config.checkpoint_dir),
                self.unreadable)
            self.on_message(
                f"launch {launch.index} could not load step {launch.resumed_from} "
                f"({failed[0]['error']}); the next launch resumes from "
                + (f"step {before}, the committed one before it" if before is not None
                   else "nothing: no earlier committed step"))

    def _survivors(self, alive: list[int], failed: LaunchRecord) -> list[int]:
        """The slots still usable: injected failures are dead; on CUDA every remaining
        device must also pass a probe."""
        self.dead.update(e["slot"] for e in failed.failures())
        candidates = probe.alive_slots(alive, self.dead)
        if self.config.launch.devices == "cuda":
            return probe.probe_cuda(candidates, self.config.launch.probe_timeout)
        return candidates
