"""The few collectives a save or load needs, and single-process fallbacks.

Every step that can fail locally ends in a collective that carries the error (``agree``,
``Comm.agree``, or ``Comm.exchange``'s ``error``): each rank contributes its error (or
``None``) and all ranks raise together, so one rank's bad input or I/O error never
leaves the others hanging in the next collective (DCP's ``_DistWrapper`` idea).
Without an initialised process group everything runs as a world of one.

What a rank sends and receives must not grow with the job (16,384 ranks): ``Comm``
agrees with one integer ``all_reduce`` (messages are gathered only when a rank failed),
moves plans with a sparse all-to-all (``exchange``) in which a rank hears only from
the ranks that have something for it (its size vector one byte per rank), and brings the coordinator what some ranks send
it with a bitmap ``all_reduce`` and point-to-point messages (``gather``). See
docs/checkpoint-format.md, "Planning at scale".
"""

from __future__ import annotations

import bisect
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from elastor_mcore.checkpoint.format import CheckpointError

ANNOUNCE_BYTES = 4096
"""The most bytes ``Comm.announce`` carries (a step directory's path or URL)."""


def _size_classes(ratio: float = 1.08) -> tuple[int, ...]:
    """256 message sizes, each at least ``ratio`` times the one before (0, 1, 2, ...,
    up to 2.4 GB): what ``exchange`` pads its messages to, so that a message's size
    travels as one byte, its class."""
    sizes = [0, 1]
    while len(sizes) < 256:
        sizes.append(max(sizes[-1] + 1, math.ceil(sizes[-1] * ratio)))
    return tuple(sizes)


SIZE_CLASSES = _size_classes()
"""``exchange``'s message sizes: a message is padded to the next (by under 8%; pickle
ignores the bytes past its end), and its size sent as the class's index, one byte per
rank of the group: the one part of a sparse all-to-all that grows with the job."""


def size_class(nbytes: int) -> int:
    """The index of the smallest of ``SIZE_CLASSES`` that holds ``nbytes``."""
    index = bisect.bisect_left(SIZE_CLASSES, nbytes)
    if index == len(SIZE_CLASSES):
        raise CheckpointError(f"a plan message of {nbytes} bytes: at most "
                              f"{SIZE_CLASSES[-1]} fit the exchange's size classes")
    return index


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def global_rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def is_coordinator(group=None) -> bool:
    """Rank 0 of ``group`` commits: it writes metadata, the manifest and ``latest``."""
    dist = _dist()
    return dist is None or dist.get_rank(group) == 0


def all_gather(value: Any, group=None) -> list[Any]:
    """Every rank's ``value``, in group-rank order."""
    dist = _dist()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(error: BaseException | None, what: str, group=None) -> None:
    """Raise ``CheckpointError`` on every rank if any rank's ``error`` is set."""
    check(all_gather(describe(error), group), what, error)


def describe(error: BaseException | None) -> str | None:
    """This rank's contribution to ``check``."""
    return None if error is None else f"rank {global_rank()}: {error}"


def check(messages: list[str | None], what: str, cause: BaseException | None = None) -> None:
    """Raise ``CheckpointError`` naming every rank whose gathered message is set."""
    failures = [m for m in messages if m is not None]
    if failures:
        raise CheckpointError(f"{what} failed on {len(failures)} rank(s): "
                              + " | ".join(failures)) from cause


def pickled(outgoing: dict[int, Any]) -> dict[int, bytes]:
    """Each message of ``outgoing`` pickled, and an object sent to many ranks (the
    coordinator's step directory, to every rank of a load) only once: the sender's
    work follows the objects it sends, not the ranks it sends them to."""
    done: dict[int, bytes] = {}
    out = {}
    for rank, message in outgoing.items():
        if id(message) not in done:
            done[id(message)] = pickle.dumps(message)
        out[rank] = done[id(message)]
    return out


@dataclass(frozen=True)
class Failed:
    """What a failed rank sends every rank in an ``exchange`` instead of its message."""

    message: str


class Comm:
    """The collectives of one save or load on ``group`` (default: the world), with
    global ranks throughout. Every rank of the group makes the same calls in the same
    order; ``calls`` counts them."""

    def __init__(self, group=None) -> None:
        self.group = group
        dist = _dist()
        if dist is None:
            self.rank, self.ranks = 0, [0]
        else:
            self.rank = dist.get_rank()
            self.ranks = (dist.get_process_group_ranks(group) if group is not None
                          else list(range(dist.get_world_size())))
        self.calls = 0

    @property
    def coordinator(self) -> int:
        """The rank that commits (rank 0 of the group)."""
        return self.ranks[0]

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _device(self):
        import torch
        import torch.distributed as dist

        return torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def sum(self, values: Sequence[int]) -> list[int]:
        """Every rank's ``values`` added up, element by element (one ``all_reduce``)."""
        return self._reduce(values, "SUM")

    def maximum(self, values: Sequence[int]) -> list[int]:
        """The largest of every rank's ``values``, element by element (one
        ``all_reduce``)."""
        return self._reduce(values, "MAX")

    def _reduce(self, values: Sequence[int], op: str) -> list[int]:
        dist = _dist()
        if dist is None:
            return list(values)
        import torch

        total = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        dist.all_reduce(total, op=getattr(dist.ReduceOp, op), group=self.group)
        self.calls += 1
        return total.tolist()

    def announce(self, text: str | None, error: BaseException | None, what: str,
                 token: int = 0) -> str:
        """The coordinator's ``text`` on every rank, with every rank's ``error``
        agreed (``CheckpointError`` on every rank if one is set) and a check that every
        rank passed the same ``token`` (a non-negative integer under 2**20), in one
        ``all_reduce`` of ``ANNOUNCE_BYTES`` plus 32 bytes: nothing in it grows with
        the group. Equal tokens are checked by their sum and sum of squares (equal
        for ``n`` ranks exactly when ``sum**2 == n * squares``)."""
        data = (text or "").encode() if self.is_coordinator else b""
        if len(data) > ANNOUNCE_BYTES:
            error = error or CheckpointError(
                f"{text[:80]}...: a path of {len(data)} bytes; at most {ANNOUNCE_BYTES} "
                f"fit a load's announcement")
            data = b""
        padded = data.ljust(ANNOUNCE_BYTES, b"\0")
        words = [int.from_bytes(padded[i:i + 8], "little", signed=True)
                 for i in range(0, ANNOUNCE_BYTES, 8)]
        total = self.sum([error is not None, token, token * token, len(data), *words])
        if total[0]:
            check([m for m, in self.messages(error)], what, error)
        if total[1] ** 2 != len(self.ranks) * total[2]:
            raise CheckpointError(
                f"{what}: the ranks passed different replica classes; every rank must "
                f"pass the same classes, built from the group's layout "
                f"(parallel.shards.replica_classes)")
        return b"".join(w.to_bytes(8, "little", signed=True)
                        for w in total[4:])[:total[3]].decode()

    def swap(self, peers: Sequence[int], values: Sequence[int]) -> dict[int, list[int]]:
        """``values`` (int64, as many on every rank) sent to each of ``peers`` and
        theirs received, point to point: for ranks that know each other in advance
        (a replica class, from the layout every rank knows) and that all call it."""
        mine = struct.pack(f"<{len(values)}q", *values)
        received = self._point_to_point(dict.fromkeys(peers, mine),
                                        dict.fromkeys(peers, len(mine)))
        return {peer: list(struct.unpack(f"<{len(values)}q", data))
                for peer, data in received.items()}

    def gather(self, message: Any, what: str,
               error: BaseException | None = None) -> dict[int, Any]:
        """Each rank's ``message`` (``None``: it sends nothing) at the coordinator, by
        sender (``{}`` on the other ranks), with every rank's ``error`` agreed
        (``CheckpointError`` on every rank, naming every failed rank, if one is set).
        One ``all_reduce`` of an error count and a bitmap of the senders (a bit per
        rank of the group: 2 KiB at 16,384 ranks), then each sender's size (8 bytes)
        and pickled message to the coordinator, point to point: a rank that sends
        nothing exchanges only the bitmap, where ``exchange``'s size vector grew with
        the group (a byte per rank each way, on every rank)."""
        position = self.ranks.index(self.rank)
        words = [0] * -(-len(self.ranks) // 64)
        if message is not None and error is None:
            bit = 1 << position % 64
            words[position // 64] = bit - (1 << 64) if bit >> 63 else bit  # int64
        total = self.sum([error is not None, *words])
        if total[0]:
            check([m for m, in self.messages(error)], what, error)
        if not self.is_coordinator:
            self.trade({self.coordinator: message} if message is not None else {}, [])
            return {}
        senders = [r for i, r in enumerate(self.ranks)
                   if r != self.rank and total[1 + i // 64] >> i % 64 & 1]
        incoming = self.trade({}, senders)
        if message is not None:
            incoming[self.rank] = message
        return dict(sorted(incoming.items()))

    def trade(self, sends: dict[int, Any], sources: Sequence[int]) -> dict[int, Any]:
        """``sends[r]`` pickled and sent to each rank ``r``, and what each of
        ``sources`` sends this rank received, by sender: point to point between ranks
        that know each other in advance (each of a pair calls it), in two rounds, each
        message's size (8 bytes), then the messages."""
        data = {r: pickle.dumps(m) for r, m in sends.items()}
        sizes = self._point_to_point({r: len(b).to_bytes(8, "little") for r, b in data.items()},
                                     dict.fromkeys(sources, 8))
        blobs = self._point_to_point(
            data, {r: int.from_bytes(size, "little") for r, size in sizes.items()})
        return {r: pickle.loads(blob) for r, blob in blobs.items()}

    def _point_to_point(self, sends: dict[int, bytes],
                        receives: dict[int, int]) -> dict[int, bytes]:
        """``sends`` to their ranks and ``receives[r]`` bytes from each rank ``r``, on
        the group's device (gloo's CPU, NCCL's GPU); what was received, by sender."""
        if _dist() is None or not (sends or receives):
            return {}
        import torch
        import torch.distributed as dist

        device = self._device()
        outbox = {r: torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
                  for r, data in sends.items()}
        inbox = {r: torch.empty(n, dtype=torch.uint8, device=device)
                 for r, n in receives.items()}
        ops = [dist.P2POp(dist.isend, t, r, self.group) for r, t in outbox.items()]
        ops += [dist.P2POp(dist.irecv, t, r, self.group) for r, t in inbox.items()]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return {r: t.cpu().numpy().tobytes() for r, t in inbox.items()}

    def failures(self, *errors: BaseException | None) -> list[tuple[str | None, ...]]:
        """Every rank's ``errors`` described (``describe``), in group order, when any
        rank has one; ``[]`` when none does. One integer ``all_reduce``, and an
        ``all_gather`` of the messages only when some rank failed."""
        counts = self.sum([e is not None for e in errors])
        return self.messages(*errors) if any(counts) else []

    def messages(self, *errors: BaseException | None) -> list[tuple[str | None, ...]]:
        """Every rank's ``errors`` described, in group order (one ``all_gather``: only
        once a rank is known to have failed)."""
        self.calls += 1
        return all_gather(tuple(describe(e) for e in errors), self.group)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise ``CheckpointError`` on every rank if any rank's ``error`` is set."""
        check([m for m, in self.failures(error)], what, error)

    def exchange(self, outgoing: dict[int, Any], what: str,
                 error: BaseException | None = None) -> dict[int, Any]:
        """Send ``outgoing[r]`` to each rank ``r``; returns what the ranks that sent
        this rank something sent, by sender. A sparse all-to-all: one
        ``all_to_all_single`` of sizes (one byte per rank of the group, a message's
        ``size_class``: the one part that grows with the job), one of the pickled
        messages, each padded to its class. With ``error``, this rank sends it to every
        rank instead, and every rank raises ``CheckpointError`` naming every failed
        rank."""
        if error is not None:
            outgoing = dict.fromkeys(self.ranks, Failed(describe(error)))
        dist = _dist()
        if dist is None:
            incoming = dict(outgoing)
        else:
            incoming = self._all_to_all(outgoing)
        failed = [m.message for m in incoming.values() if isinstance(m, Failed)]
        check(failed, what, error)
        return incoming

    def _all_to_all(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        import torch
        import torch.distributed as dist

        device = self._device()
        messages = pickled({r: m for r, m in outgoing.items() if r != self.rank})
        classes = [size_class(len(messages.get(r, b""))) for r in self.ranks]
        blobs = [messages.get(r, b"").ljust(SIZE_CLASSES[c], b"\0")
                 for r, c in zip(self.ranks, classes)]
        sizes = torch.tensor(classes, dtype=torch.uint8, device=device)
        receive_classes = torch.empty_like(sizes)
        dist.all_to_all_single(receive_classes, sizes, group=self.group)
        receive_sizes = [SIZE_CLASSES[c] for c in receive_classes.tolist()]
        data = b"".join(blobs)
        send = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                else torch.empty(0, dtype=torch.uint8)).to(device)
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, send, receive_sizes, [len(b) for b in blobs],
                               group=self.group)
        self.calls += 2
        raw = received.cpu().numpy().tobytes()
        incoming, start = {}, 0
        for rank, size in zip(self.ranks, receive_sizes):
            if size:
                incoming[rank] = pickle.loads(raw[start:start + size])
            start += size
        if self.rank in outgoing:
            incoming[self.rank] = outgoing[self.rank]
        return dict(sorted(incoming.items()))

    def broadcast(self, value: Any) -> Any:
        """The coordinator's ``value`` on every rank (one ``broadcast_object_list``)."""
        dist = _dist()
        if dist is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        self.calls += 1
        return box[0]
