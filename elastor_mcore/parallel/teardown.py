"""Leave every process group at once, even with collectives pending on peers: the
first step of a recovery in place (``elastic/rank/inplace.py``).

A rank whose peer died has its collective fail; a rank blocked on a survivor stays
blocked until that survivor closes its connections. gloo has no abort in torch 2.13 and
2.14 (``ProcessGroup.abort`` and ``shutdown`` return but leave its connections open,
measured), and ``destroy_process_group`` closes a group's connections only when the last
reference to it goes (the model, the optimizer and mcore's ``parallel_state`` keep
theirs). So the rank shuts down its connections itself, at the socket: every
established TCP connection of the process except those to the store, which the
recovery goes on using. Every collective waiting on one of them fails at once, here
and on the peer, so the failure reaches every survivor. Then the groups are destroyed.

That is gloo's path (CPU ranks), the one run here. NCCL moves data outside these
sockets; its groups would need ``ProcessGroup.abort`` (NCCL implements it), which no
run here has exercised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

import torch.distributed as dist

log = logging.getLogger(__name__)


def _addresses(host: str) -> set[str]:
    """Every address ``host`` resolves to, with IPv4 ones also as IPv4-mapped IPv6."""
    found = set()
    with contextlib.suppress(OSError):
        for *_, sockaddr in socket.getaddrinfo(host, None):
            found.add(sockaddr[0])
            found.add(f"::ffff:{sockaddr[0]}")
    return found


def shut_connections(keep: tuple[str, int] | None) -> int:
    """Shut down (both ways) every connected TCP socket of this process except those
    to ``keep`` (host, port); returns how many were shut. Linux (``/proc/self/fd``)."""
    keep_hosts = _addresses(keep[0]) if keep else set()
    fds = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    shut = 0
    for name in os.listdir(fds):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not ours to read
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                    or sock.type != socket.SOCK_STREAM:
                continue
            try:
                host, port = sock.getpeername()[:2]
            except OSError:
                continue  # a listening socket
            if keep and port == keep[1] and host in keep_hosts:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
    return shut


def leave_groups(store_address: tuple[str, int] | None) -> None:
    """Fail every pending collective of this process and its peers', then destroy every
    process group (see the module docstring). ``store_address``: the store's
    (host, port), whose connections stay."""
    if not dist.is_initialized():
        return
    shut = shut_connections(store_address)
    log.info("left the process groups: %d connections shut", shut)
    dist.destroy_process_group()
