"""crc32c over raw memory, from the C library inside ``google-crc32c``.

The package's public ``value`` accepts only ``bytes`` (a copy of the tensor) and holds
the GIL; its C library's ``crc32c_extend``, called through ctypes, reads a tensor's
memory in place and releases the GIL. That library is a private module of the package
(``google_crc32c._crc32c``), so reaching it is a shim and lives here; it is checked
against the public ``value`` once, and ``available()`` is False when either is missing
or they disagree (the checkpoint's fast paths then fall back to TensorStore).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable

log = logging.getLogger(__name__)


def _load() -> Callable[[int, int, int], int] | None:
    try:
        import google_crc32c
        from google_crc32c import _crc32c  # type: ignore[attr-defined]
    except ImportError:
        log.warning("google-crc32c has no C extension here; checkpoint loads use "
                    "TensorStore (slower)")
        return None
    extend = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    extend.restype = ctypes.c_uint32
    extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    if extend(0, ctypes.cast(ctypes.c_char_p(b"123456789"), ctypes.c_void_p).value,
              9) != google_crc32c.value(b"123456789"):
        log.warning("google-crc32c's C library disagrees with its module; checkpoint "
                    "loads use TensorStore")
        return None
    return extend


_extend = _load()


def available() -> bool:
    """Whether ``crc32c`` works here (the checkpoint's fast paths need it)."""
    return _extend is not None


def crc32c(address: int, nbytes: int) -> int:
    """The crc32c of ``nbytes`` of memory at ``address`` (GIL released)."""
    return _extend(0, address, nbytes)
