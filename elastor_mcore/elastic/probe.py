"""Which devices survived a failure.

CUDA: each candidate device runs a small kernel in its own subprocess under a
timeout (``probe_cuda``), so a wedged device or driver stalls only its probe, never
the caller: the single-host supervisor probes the survivors, a rank of a multi-node
round (``elastic.rank.rendezvous_round``) its own device.
CPU: a "device" is a rank slot and cannot break; the slots whose failure was injected
count as dead (``alive_slots``), which is also how an injected failure on CUDA stands
for a dead GPU.

Standard library only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

CUDA_PROBE = (
    "import torch\n"
    "x = torch.arange(1 << 20, device=torch.device('cuda', 0), dtype=torch.float32)\n"
    "assert float((x * 2).sum()) == float(x.sum()) * 2\n"
    "torch.cuda.synchronize()\n")
"""Allocate, compute and synchronise on the one visible device."""


def probe_cuda(devices: Iterable[int], timeout_s: float,
               script: str = CUDA_PROBE) -> list[int]:
    """Devices whose probe succeeded within ``timeout_s``; all probes run in parallel."""
    procs = {}
    for device in devices:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device))
        procs[device] = subprocess.Popen([sys.executable, "-c", script], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(0.05)
    alive = []
    for device, proc in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            log.warning("device %d: probe did not finish in %.0f s; counted dead",
                        device, timeout_s)
        elif proc.returncode == 0:
            alive.append(device)
        else:
            err = proc.stderr.read().decode(errors="replace").strip().splitlines()
            log.warning("device %d: probe failed (exit %d): %s", device, proc.returncode,
                        err[-1] if err else "")
        proc.stderr.close()
    return sorted(alive)


def alive_slots(slots: Sequence[int], dead: Iterable[int]) -> list[int]:
    """The slots not known dead."""
    dead = set(dead)
    return [s for s in slots if s not in dead]
