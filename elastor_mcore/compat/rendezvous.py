"""Torch's c10d rendezvous without the wait for a lost node's keep-alives to expire:
the ``elastor-c10d`` rendezvous backend, and the entry point that runs torch's elastic
agent with it (``python -m elastor_mcore.compat.rendezvous``, torchrun's arguments).

Why: torch's ``DynamicRendezvousHandler`` keeps a participant of a complete round until
its keep-alives expire (``keep_alive_interval`` x ``keep_alive_max_attempt``, 5 s x 3 by
default), and a complete round becomes incomplete only once its participants list is
empty; the survivors of a lost node remove themselves, so they wait for that expiry
before the next round can even start its last call. A shorter keep-alive does not
scale: a keep-alive is a compare-and-set of the whole pickled state (O(nodes) bytes),
so N nodes beating every T seconds write O(N^2 / T) bytes a second to the store, and
each write fails every other node's pending one (its token is stale).

Here each agent's own thread adds 1 to a key of its own in the rendezvous store every
``liveness_timeout / 4`` seconds (O(1) bytes, over a store connection of its own, so
that none of the agent's blocking store calls delays it). While its node waits in a
rendezvous (it is not a participant of a complete round), every state this backend
reads or writes passes ``LivenessBackend.evict_dead``: a participant whose counter
this node has seen unchanged for ``liveness_timeout`` seconds of its own clock (no
clock comparison between nodes) is dead; its last keep-alive is set back to the epoch
and written, and torch's own sanitizer, on every node that reads the state, then drops
it exactly as after an expiry. A node that is only slow still has its agent writing,
so it is never evicted. ``--rdzv-conf liveness_timeout=0`` turns this off: the
rendezvous is then torch's c10d one. Every other ``--rdzv-conf`` key is torch's, read by torch.

Torch-version-sensitive (the same in torch 2.13 and 2.14): the fields of the pickled
rendezvous state (``complete``, ``round``, ``participants``, ``last_heartbeats``) and
the handler's ``_this_node``.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from torch.distributed import Store
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (RendezvousBackend,
                                                                     create_handler)

log = logging.getLogger(__name__)

BACKEND = "elastor-c10d"
LIVENESS_TIMEOUT_S = 1.5
"""Default ``liveness_timeout``: four of a live agent's writes (every 0.375 s) missed."""
EVICTED = "elastor-c10d: evicted node"
"""How each eviction's log line starts (``elastic.node`` records it)."""
EPOCH = datetime.fromtimestamp(0, timezone.utc)


def liveness_key(run_id: str, node: object) -> str:
    """The store key a node's agent counts up (``node``: torch's node descriptor)."""
    return f"elastor.rendezvous.{run_id}.alive.{node!r}"


def start_liveness(store: Store, key: str, interval: float) -> Callable[[], None]:
    """Count ``key`` up now (before the node can join a round) and then every
    ``interval`` seconds from a thread, until the returned function is called; it is
    called at exit too: a write that fails while the interpreter finalizes (the
    store's server, in the host's agent, torn down) aborts the process."""
    store.add(key, 1)
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.wait(interval):
            try:
                store.add(key, 1)
            except (RuntimeError, TimeoutError) as exc:  # the store is back or gone soon
                log.debug("liveness write failed: %s", exc)

    thread = threading.Thread(target=beat, name="elastor-liveness", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(timeout=5)  # a write hung on an unreachable store: exit anyway

    atexit.register(stop)
    return stop


class LivenessBackend(RendezvousBackend):
    """Torch's c10d backend (``inner``), evicting dead participants from the states it
    passes on while its node waits in a rendezvous (see the module docstring)."""

    def __init__(self, inner: RendezvousBackend, store: Store, run_id: str,
                 timeout: float) -> None:
        self.inner, self.store, self.run_id, self.timeout = inner, store, run_id, timeout
        self.node: object = None
        """This handler's node descriptor, set once torch created the handler."""
        self.seen: dict[str, tuple[bytes, float]] = {}
        """Liveness key -> its value and when this node first saw that value."""

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Any] | None:
        got = self.inner.get_state()
        return got and self.evict_dead(*got)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        got = self.inner.set_state(state, token)
        return got and (*self.evict_dead(got[0], got[1]), got[2])

    def evict_dead(self, bits: bytes, token: Any) -> tuple[bytes, Any]:
        """The state (and its token) after backdating the keep-alives of the dead
        participants, if this node waits and any are dead; as read otherwise (also when
        another node wrote first: the next read tries again)."""
        if not self.timeout:
            return bits, token
        state = pickle.loads(bits)
        if state.complete and self.node in state.participants:
            return bits, token  # this node's round is running: nothing to wait for
        dead = self.dead([node for node in state.participants if node != self.node])
        if not dead:
            return bits, token
        for node in dead:
            state.last_heartbeats[node] = EPOCH
        written = self.inner.set_state(pickle.dumps(state), token)
        if written is None:
            return bits, token
        if written[2]:
            for node in dead:
                log.warning("%s '%r' from round %d of the rendezvous '%s': its agent wrote "
                            "no liveness for %.1f s", EVICTED, node, state.round, self.run_id,
                            self.timeout)
        return written[0], written[1]

    def dead(self, nodes: list[object]) -> list[object]:
        """Those of ``nodes`` whose liveness this node has seen unchanged for the
        timeout. None if any has no liveness key (a node not run with this backend) or
        the store fails to answer: torch's keep-alive alone decides then."""
        keys = [liveness_key(self.run_id, node) for node in nodes]
        try:
            if not keys or not self.store.check(keys):
                return []
            values = self.store.multi_get(keys)
        except (RuntimeError, TimeoutError) as exc:
            log.debug("liveness read failed: %s", exc)
            return []
        now = time.monotonic()
        for key, value in zip(keys, values):
            if self.seen.get(key, (None,))[0] != value:
                self.seen[key] = (value, now)
        return [node for node, key in zip(nodes, keys) if now - self.seen[key][1] >= self.timeout]


def liveness_timeout(params: RendezvousParameters) -> float:
    """``--rdzv-conf liveness_timeout`` in seconds (0: no eviction)."""
    raw = params.get("liveness_timeout", LIVENESS_TIMEOUT_S)
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if timeout < 0:
        raise ValueError(f"--rdzv-conf liveness_timeout must be seconds >= 0 (0: no "
                         f"eviction, torch's keep-alive expiry only), got {raw!r}")
    return timeout


def create_liveness_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Torch's c10d handler (its store, backend and ``--rdzv-conf``) over a
    ``LivenessBackend``; with ``liveness_timeout`` 0 that evicts nobody and no liveness
    is written (torch's registry wants the handler to name the backend asked for)."""
    timeout = liveness_timeout(params)
    inner, store = create_backend(params)
    own = store.clone()  # the liveness thread's connection
    backend = LivenessBackend(inner, own, params.run_id, timeout)
    handler = create_handler(store, backend, params)
    backend.node = handler._this_node
    if timeout:
        start_liveness(own, liveness_key(params.run_id, backend.node), timeout / 4)
    return handler


def main(argv: list[str] | None = None) -> None:
    """Torch's elastic agent (``torch.distributed.run``'s arguments), which may use
    ``--rdzv-backend elastor-c10d``. Evictions are logged to stderr."""
    rendezvous_handler_registry.register(BACKEND, create_liveness_handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    torchrun.main(argv)


if __name__ == "__main__":
    main()
