"""The in-memory tier: the training state of the latest step in host memory, on this
rank and on a peer on another node.

Every ``interval`` steps, as soon as the optimizer step is done, each active rank
copies its training state (what a checkpoint saves, ``state.state_shards``: fp32 main
weights and Adam moments, its ZeRO-1 boxes only) into a host buffer, and sends that
copy to its *partner* (``replica_partners``: an active rank on another node when
there is one; on one host, another slot), which keeps it in its own host memory. Both
run on a background thread, overlapped with the rest of the step (the loss
reduction, the durable tier's save, the step's report); the loop waits for them
(``MemoryTier.wait``) before it reports the step done, so a failure at any point of
the next step finds this step whole in two processes' memory. The durable zarr tier
saves on its own interval.

Each rank keeps two versions of its own copy and of the replica it holds: the one
being written and the last complete one, so a failure in the middle of a copy leaves
the previous step whole everywhere.

What a buffer holds is described as the checkpoint describes shards: one
``ShardInfo`` (key, global shape, box) per tensor (``Holding``). Any layout can
therefore take it: ``restore`` fills the state of every rank of a new layout from the
copies the survivors hold, each cell sent once, peer to peer, by one survivor that
holds it (``plan_restore``); what no survivor holds at that step is read from the
zarr checkpoint of the same step, if there is one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from elastor_mcore.checkpoint import LocalShard, comm
from elastor_mcore.geometry import ShardInfo

log = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of each tensor in a host buffer (a cache line)."""
VERSIONS = 2
"""Copies kept per buffer: the one being written and the last complete one."""


class RestoreError(RuntimeError):
    """The survivors' copies (and the durable checkpoint) cannot rebuild any one step."""


@dataclass(frozen=True)
class Holding:
    """What one complete host buffer holds: one rank's whole training state at a step."""

    owner: int
    """The rank (in the world the copy was made in) whose state it is."""
    step: int
    """Steps done when the copy was made."""
    shards: tuple[ShardInfo, ...]
    offsets: tuple[int, ...]
    """Byte offset of each shard in the buffer."""
    schedule: dict
    """The lr schedule's state at ``step`` (mcore ``OptimizerParamScheduler.state_dict``)."""

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each shard as a tensor view of ``buffer``."""
        return [buffer[o:o + nbytes(info)].view(getattr(torch, info.dtype)).view(info.box.shape)
                for info, o in zip(self.shards, self.offsets)]


@dataclass
class HostCopy:
    """One version of a buffer: its bytes and, once complete, what they hold."""

    buffer: torch.Tensor
    holding: Holding | None = None


def nbytes(info: ShardInfo) -> int:
    return info.box.numel * torch.empty((), dtype=getattr(torch, info.dtype)).element_size()


def buffer_layout(shards: Sequence[ShardInfo]) -> tuple[tuple[int, ...], int]:
    """Each shard's aligned byte offset in one buffer, and the buffer's size."""
    offsets, total = [], 0
    for info in shards:
        offsets.append(total)
        total += -(-nbytes(info) // ALIGN) * ALIGN
    return tuple(offsets), total


def replica_partners(ranks: Sequence[int], node_of: dict[int, int]) -> dict[int, int]:
    """Each rank's partner, the rank that keeps its replica: the next rank in a ring that
    takes the nodes in turn (node 0's first rank, node 1's first, ..., node 0's second),
    so a replica lands on another node wherever the node sizes allow. One rank alone has
    itself (no replica)."""
    by_node: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(node_of[rank], []).append(rank)
    columns = [by_node[n] for n in sorted(by_node)]
    ring = [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    return {rank: ring[(i + 1) % len(ring)] for i, rank in enumerate(ring)}


def allocate(size: int, pin: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


@dataclass
class _Job:
    step: int
    schedule: dict
    ready: object | None
    """A CUDA event recorded after the optimizer step (None on CPU)."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    copy_s: float = 0.0
    replica_s: float = 0.0


class MemoryTier:
    """One active rank's part of the tier for one layout (see the module docstring).

    Build it with ``MemoryTier.build`` on every world rank (it creates the group its
    replicas travel on); ``snapshot`` after an optimizer step, ``wait`` before the step
    counts as done, ``copies`` for a recovery.
    """

    def __init__(self, shards: Sequence[LocalShard], rank: int, partner: int, source: int,
                 source_shards: Sequence[ShardInfo], group: dist.ProcessGroup | None) -> None:
        self.live = list(shards)
        """Views of the live state (``state.state_shards``)."""
        self.rank, self.partner, self.source, self.group = rank, partner, source, group
        infos = tuple(s.info() for s in self.live)
        self.offsets, size = buffer_layout(infos)
        self.infos = infos
        self.source_infos = tuple(source_shards)
        self.source_offsets, source_size = buffer_layout(self.source_infos)
        self.on_device = any(s.data.device.type != "cpu" for s in self.live)
        self.own = [HostCopy(allocate(size, self.on_device)) for _ in range(VERSIONS)]
        self.replicas = [HostCopy(allocate(source_size, self.on_device))
                         for _ in range(VERSIONS)] if self.replicates else []
        self.timings: list[tuple[int, float, float, float]] = []
        """(step, local copy s, replica s, wait s) of every snapshot, for measurements."""
        self._job: _Job | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="elastor-memory-tier")
        self._thread.start()
        log.info("memory tier: rank %d holds %d bytes of its state and %d of rank %d's "
                 "(replica sent to rank %d)", rank, size, source_size, source, partner)

    @classmethod
    def build(cls, shards: Sequence[LocalShard], active: Sequence[int],
              node_of: dict[int, int]) -> "MemoryTier | None":
        """Collective over the world (idle ranks too, with no shards: None for them):
        the partners, a group of the active ranks for the replicas, and the shard
        descriptions of the rank whose replica this one keeps (its source), point to
        point: each rank sends its own to its partner, so what a rank moves follows
        its own state, not the job (a gather of every rank's brought each rank 17 KB
        per rank of the job for Llama 3 405B's stages at TP 8, PP 16: 282 MB at 16,384
        ranks)."""
        group = dist.new_group(sorted(active))
        rank = dist.get_rank()
        if rank not in active:
            return None
        partners = replica_partners(active, node_of)
        source = next(r for r, p in partners.items() if p == rank)
        infos = [s.info() for s in shards]
        heard = comm.Comm(group).trade({partners[rank]: infos} if partners[rank] != rank
                                       else {}, [source] if source != rank else [])
        return cls(shards, rank, partners[rank], source, heard.get(source, infos),
                   group if len(active) > 1 else None)

    @property
    def replicates(self) -> bool:
        return self.partner != self.rank

    # ----- the loop's side --------------------------------------------------------
    def snapshot(self, step: int, schedule: dict) -> None:
        """Start copying the live state of ``step`` (after its optimizer step); returns
        at once. The previous snapshot must have been waited for."""
        if self._job is not None:
            raise RuntimeError("MemoryTier.snapshot before the previous snapshot's wait")
        ready = None
        if self.on_device:
            ready = torch.cuda.Event()
            ready.record()
        self._job = _Job(step, dict(schedule), ready)
        self._jobs.put(self._job)

    def wait(self) -> float:
        """Block until the snapshot in flight (if any) is in both memories; returns the
        seconds blocked. Raises what the copy raised (a peer gone: a collective error)."""
        job, self._job = self._job, None
        if job is None:
            return 0.0
        start = time.perf_counter()
        job.done.wait()
        waited = time.perf_counter() - start
        self.timings.append((job.step, job.copy_s, job.replica_s, waited))
        if job.error is not None:
            raise job.error
        return waited

    def copies(self) -> list[tuple[Holding, torch.Tensor]]:
        """Every complete copy this rank holds (its own and the replica), newest first."""
        held = [(c.holding, c.buffer) for c in (*self.own, *self.replicas)
                if c.holding is not None]
        return sorted(held, key=lambda h: -h[0].step)

    def close(self) -> None:
        """Stop the background thread (after ``wait``)."""
        self._jobs.put(None)

    def abandon(self, timeout_s: float = 30.0) -> list[tuple[Holding, torch.Tensor]]:
        """For a recovery, once this rank has left the broken groups: let the copy in
        flight end (without its peers it fails fast), stop, and return every complete
        copy (``copies``)."""
        job, self._job = self._job, None
        if job is not None and not job.done.wait(timeout_s):
            log.warning("memory tier: the copy of step %d did not end within %.0fs; "
                        "restoring without it", job.step, timeout_s)
        self.close()
        return self.copies()

    # ----- the background thread -----------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._copy(job)
            except BaseException as exc:  # handed to wait() on the loop's thread
                job.error = exc
            finally:
                job.done.set()

    def _copy(self, job: _Job) -> None:
        own = self.own[self._next_slot(self.own)]
        own.holding = None
        start = time.perf_counter()
        if job.ready is not None:
            job.ready.synchronize()
        holding = Holding(self.rank, job.step, self.infos, self.offsets, job.schedule)
        with torch.no_grad():
            for view, shard in zip(holding.views(own.buffer), self.live):
                view.copy_(shard.data)
        own.holding = holding
        job.copy_s = time.perf_counter() - start
        if not self.replicates:
            return
        start = time.perf_counter()
        replica = self.replicas[self._next_slot(self.replicas)]
        replica.holding = None
        requests = [dist.isend(own.buffer, self.partner, group=self.group),
                    dist.irecv(replica.buffer, self.source, group=self.group)]
        for request in requests:
            request.wait()
        replica.holding = Holding(self.source, job.step, self.source_infos, self.source_offsets,
                                  job.schedule)
        job.replica_s = time.perf_counter() - start

    @staticmethod
    def _next_slot(copies: list[HostCopy]) -> int:
        """The version to overwrite: an empty one, else the older complete one."""
        for i, c in enumerate(copies):
            if c.holding is None:
                return i
        return min(range(len(copies)), key=lambda i: copies[i].holding.step)
