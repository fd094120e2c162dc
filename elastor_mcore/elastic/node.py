"""One node of a multi-node job: run torch's elastic agent for this node's slots and
watch its workers for hangs.

Torch's agent (``torch.distributed.run --nnodes MIN:MAX``, with torch's c10d rendezvous
less the wait for a lost node's keep-alives: ``compat.rendezvous``) does membership,
rendezvous, restarts (``--max-restarts``) and scale-up: when a worker fails, when a
node is lost (its workers' peers fail) or when a node joins, every agent stops its
workers and the next round starts fresh ones on the nodes present, which agree on a
layout for the healthy devices (``elastic.rank.rendezvous_round``) and resume from the
latest committed checkpoint. This launcher adds what torch has not:

- hangs: a worker whose heartbeat stops is SIGKILLed (torch then sees a failure);
- the agent's log lines, timestamped as they arrive (detection, rendezvous, start of
  workers), for the recovery timeline (``node_timeline``);
- the job's end, as its workers wrote it (finished, or given up with the reason).

Node directory (``<run dir>/nodes/<node>/<K>``, K counting this node's launches: a node
started again is a repaired node: the failures injected before do not count)::

    agent.log         the agent's and workers' output
    launcher.jsonl    agent lines and hang kills, timestamped
    rounds.jsonl      each round this node took part in (members, plan)
    rounds/<R>/       layout.yaml, events.jsonl, heartbeat/, metrics.jsonl (reporter)
    outcome.json      written by the workers at the end
    timeline.json     the rounds and the recoveries between them
    zygote.log        the node's pre-imported worker's output (``elastic.prestart``)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from elastor_mcore.checkpoint.lease import CheckpointLease
from elastor_mcore.config.launch import NodeSettings, RoundSettings
from elastor_mcore.elastic import node_timeline, prestart
from elastor_mcore.elastic.job import JobConfig
from elastor_mcore.elastic.protocol import (HEARTBEAT_DIR, LAUNCHER_EVENTS, OUTCOME_FILE,
                                            ROUNDS_DIR, append_event, read_beats)
from elastor_mcore.elastic.supervisor import STOP_GRACE_S, process_running, stop_job
from elastor_mcore.elastic.torchrun import (elastic_agent_command, forwarding_stop_signals,
                                            start_torchrun)

log = logging.getLogger(__name__)

AGENT_LINES = (
    ("agent_failed", re.compile(r"Worker group (FAILED|UNHEALTHY)")),
    ("agent_join", re.compile(r"Detected \d+ new nodes")),
    ("rendezvous_start", re.compile(r"Rendezvous'ing worker group")),
    ("rendezvous_done", re.compile(r"Rendezvous complete for workers")),
    ("workers_start", re.compile(r"Starting worker group")),
    ("node_evicted", re.compile(r"elastor-c10d: evicted node")),
)
"""The agent's INFO lines (same text in torch 2.13 and 2.14) that time a recovery, and
the rendezvous's evictions of lost nodes (``compat.rendezvous.EVICTED``, not imported:
it would load torch.distributed into the launcher)."""
PROGRESS = re.compile(r"(step +\d+  loss|step time:|planner:)")
"""The reporting rank's lines (``elastic.rank.worker.MetricsPrinter``), echoed for people."""
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception)(: .*)?$")
"""A traceback's last line: the failure message names the agent's latest one."""


@dataclass(frozen=True, kw_only=True)
class NodeConfig(JobConfig):
    """One node of a job of several; the launcher sets save, hardware and elastic paths.
    The checkpoint root (``--checkpoint-dir``, or ``<run_dir>/checkpoints``) must be one
    that every node reaches."""

    nodes: NodeSettings
    """The job's rendezvous, checked, with this node's name (unique per node)."""
    slots: int
    """This node's slots; a failure plan names them 0..slots-1."""

    def __post_init__(self) -> None:
        if self.slots <= 0:
            raise ValueError(f"--slots must be positive, got {self.slots}")
        self.nodes.check()
        if not self.nodes.several or not self.nodes.node_name:
            raise ValueError("a node of a job needs --rdzv-endpoint, --nnodes, --rdzv-id "
                             "and its name")
        super().__post_init__()

    @property
    def failure_slots(self) -> Sequence[int]:
        return range(self.slots)

    @property
    def node(self) -> str:
        return self.nodes.node_name


@dataclass
class NodeOutcome:
    finished: bool
    reason: str
    node_dir: Path
    exit_code: int | None = None
    stopped_by: int | None = None
    timeline: node_timeline.NodeTimeline | None = field(default=None, repr=False)


def next_node_dir(run_dir: Path, node: str) -> Path:
    """``<run dir>/nodes/<node>/<K>``, a new K for every launch of this node."""
    parent = run_dir / "nodes" / node
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in parent.iterdir() if p.name.isdigit()]
    path = parent / str(max(taken, default=-1) + 1)
    path.mkdir()
    return path


class NodeLauncher:
    """Runs this node's agent to the end of the job; see the module docstring."""

    def __init__(self, config: NodeConfig,
                 on_message: Callable[[str], None] = log.info) -> None:
        self.config = config
        self.on_message = on_message
        self.node_dir = next_node_dir(config.run_dir, config.node)
        self.events = self.node_dir / LAUNCHER_EVENTS
        self.prestart_env: dict[str, str] = {}
        """Points the keepers to this node's pre-imported worker (``elastic.prestart``)."""
        self.killed: set[int] = set()
        """Workers killed as hung (dying takes a moment: kill each once)."""
        self.last_error = ""
        """agent.log's latest traceback line (the agent's or a worker's), for a failure."""

    def command(self) -> list[str]:
        """The elastic agent's command: it starts the workload's round command on every
        slot at every round."""
        cfg = self.config
        node = RoundSettings(
            node_name=cfg.node, node_dir=str(self.node_dir),
            store_endpoint=cfg.nodes.rdzv_endpoint, job_id=cfg.nodes.rdzv_id,
            devices=cfg.launch.devices, probe_timeout=cfg.launch.probe_timeout,
            health_file=cfg.nodes.health_file, use_all_slots=cfg.launch.use_all_slots)
        rank = cfg.workload.round_command(node, str(cfg.checkpoint_dir), str(cfg.hardware_path),
                                          str(self.node_dir))
        if cfg.workload.prestarted:  # under a keeper, from the pre-imported worker
            rank = prestart.keeper_command(rank, in_place=False)
        return elastic_agent_command(cfg.slots, cfg.nodes, cfg.launch.max_restarts,
                                     rank.module, rank.args)

    def run(self) -> NodeOutcome:
        """Run the agent until it exits; the nodes of one job share the checkpoint
        root's lease (its job id is the rendezvous id)."""
        cfg = self.config
        self.on_message(f"node {cfg.node}: {cfg.slots} slots, rendezvous "
                        f"{cfg.nodes.rdzv_endpoint} id {cfg.nodes.rdzv_id} (nodes "
                        f"{cfg.nodes.nnodes}); files in {self.node_dir}")
        with CheckpointLease(cfg.checkpoint_dir, f"rdzv:{cfg.nodes.rdzv_id}") as lease, \
                prestart.prestarted(cfg.launch.zygote and cfg.workload.prestarted,
                                    self.node_dir / "zygote.log",
                                    imports=cfg.workload.zygote_imports) as self.prestart_env:
            outcome = self._run_agent(lease)
        outcome.timeline = node_timeline.build(self.node_dir)
        node_timeline.write_json(self.node_dir / "timeline.json", outcome.timeline)
        return outcome

    def _run_agent(self, lease: CheckpointLease) -> NodeOutcome:
        cfg = self.config
        # INFO: the agent's lines that time a recovery. Not sharing the rendezvous
        # store with the workers: with sharing (torch's default), a node joining a
        # running job waits forever for the worker store's address, which the rank-0
        # agent publishes only in its first round (torch 2.13, 2.14).
        env = {"LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               **self.prestart_env}
        if cfg.launch.devices == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get(
                "CUDA_VISIBLE_DEVICES", ",".join(map(str, range(cfg.slots))))
        proc = start_torchrun(self.command(), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lease.refresh()  # names the agent: the lease holds until it is gone
        reader = threading.Thread(target=self._read_agent, args=(proc,), daemon=True)
        reader.start()
        stopped_by = None
        try:
            with forwarding_stop_signals(proc) as received:
                while proc.poll() is None and not received:
                    self._kill_hung()
                    time.sleep(cfg.poll_s)
                if received:
                    stopped_by = received[0]
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=STOP_GRACE_S)
        finally:
            if proc.poll() is None:
                stop_job(proc, [b.pid for b in self._beats().values()])
            proc.wait()
            reader.join(timeout=5)
        return self._outcome(proc.returncode, stopped_by)

    def _read_agent(self, proc: subprocess.Popen) -> None:
        """Copy the agent's output to agent.log, timestamping the lines that matter."""
        with open(self.node_dir / "agent.log", "wb") as out:
            for raw in proc.stdout:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace")
                if PROGRESS.match(line):
                    self.on_message(f"node {self.config.node}: {line.strip()}")
                text = line.strip()
                if ERROR_LINE.match(text):
                    self.last_error = text[-300:]
                for event, pattern in AGENT_LINES:
                    if pattern.search(line):
                        append_event(self.events, event, line=text[-300:])

    def _current_round(self) -> Path | None:
        rounds = [p for p in (self.node_dir / ROUNDS_DIR).glob("*") if p.name.isdigit()]
        return max(rounds, key=lambda p: int(p.name), default=None)

    def _beats(self):
        current = self._current_round()
        return read_beats(current / HEARTBEAT_DIR) if current else {}

    def _kill_hung(self) -> None:
        """SIGKILL this round's silent workers (``hang_killed`` in launcher.jsonl):
        torch sees failed workers and starts the next round. A hung collective silences
        every rank in it, on every node, so each node kills its own; as on one host,
        only an injected failure (or the CUDA probe) makes a slot dead."""
        cfg = self.config
        now = time.time()
        for slot, beat in self._beats().items():
            if beat.pid in self.killed or not process_running(beat.pid):
                continue
            silent = cfg.hang.silent_slots([slot], {slot: beat}, beat.time, now,
                                           cfg.workload.steps)
            if silent:
                append_event(self.events, "hang_killed", slot=slot, pid=beat.pid,
                             silent_s=now - beat.time, step=beat.step,
                             timeout=silent[slot].rule)
                self.on_message(f"node {cfg.node}: slot {slot} sent no heartbeat for "
                                f"{now - beat.time:.0f}s (step {beat.step}, "
                                f"{silent[slot].rule}): hung; killed")
                self.killed.add(beat.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat.pid, signal.SIGKILL)

    def _outcome(self, code: int, stopped_by: int | None) -> NodeOutcome:
        if stopped_by is not None:
            name = signal.Signals(stopped_by).name
            return NodeOutcome(False, f"stopped by {name}", self.node_dir, code, stopped_by)
        path = self.node_dir / OUTCOME_FILE
        if path.is_file():
            data = json.loads(path.read_text())
            return NodeOutcome(data["finished"], data["reason"], self.node_dir, code)
        return NodeOutcome(
            False, f"the elastic agent exited with code {code} without the job ending (its "
                   f"restarts, --max-restarts {self.config.launch.max_restarts}, are used up, "
                   f"or the rendezvous closed); see {self.node_dir}/agent.log"
                   + (f" (its last error: {self.last_error})" if self.last_error else ""),
            self.node_dir, code)
