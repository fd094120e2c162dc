"""``compat.rendezvous``'s liveness on a real TCPStore: a node whose agent keeps counting
its key is never dead, one whose counting stopped is, once this node has seen its key
unchanged for the timeout. The whole rendezvous with a lost node is
``tests/test_elastic_nodes.py::test_a_lost_node_is_evicted_not_waited_for``."""

import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastor_mcore.compat import rendezvous
from elastor_mcore.compat.rendezvous import (LivenessBackend, liveness_key, liveness_timeout,
                                             start_liveness)
from elastor_mcore.elastic import node, torchrun

TIMEOUT_S = 1.0


@pytest.mark.timeout(60)
def test_only_a_node_that_stopped_counting_is_dead():
    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                     timeout=timedelta(seconds=10))
    stop = start_liveness(store.clone(), liveness_key("job", "alive"), TIMEOUT_S / 4)
    store.add(liveness_key("job", "gone"), 1)  # counted once: its agent died
    backend = LivenessBackend(inner=None, store=store, run_id="job", timeout=TIMEOUT_S)
    verdicts, unknown = [], []
    end = time.monotonic() + 2.5 * TIMEOUT_S
    try:
        while time.monotonic() < end:
            verdicts.append(backend.dead(["alive", "gone"]))
            unknown.append(backend.dead(["gone", "never-counted"]))  # not this backend's
            time.sleep(0.1)
    finally:
        stop()
    assert all("alive" not in v for v in verdicts), verdicts
    assert verdicts[0] == [] and verdicts[-1] == ["gone"], verdicts
    assert not any(unknown), unknown


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_liveness_timeout_is_refused_by_name(value):
    params = RendezvousParameters("elastor-c10d", "127.0.0.1:1", "job", 1, 2,
                                  liveness_timeout=value)
    with pytest.raises(ValueError, match="liveness_timeout must be seconds >= 0"):
        liveness_timeout(params)


def test_the_launcher_names_this_backend_and_reads_its_evictions():
    """The launcher writes the agent's module, the backend and the eviction line's start
    as text (importing ``compat.rendezvous`` would load torch.distributed into it): they
    must stay this module's."""
    assert torchrun.AGENT_MODULE == rendezvous.__name__
    assert torchrun.RDZV_BACKEND == rendezvous.BACKEND
    (evicted,) = [pattern for name, pattern in node.AGENT_LINES if name == "node_evicted"]
    assert evicted.search(f"2026-12-04 12:00:00 {rendezvous.EVICTED} 'a' from round 3")
