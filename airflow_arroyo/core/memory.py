"""Hand the C library's free memory back to the operating system.

A long-running driver allocates and frees native memory from many threads (py4j's callback threads, the stages'
threads, the controller), and glibc keeps what they free in its heaps (the main one and one arena per thread
group) for reuse: freed pages stay resident and the process's RSS climbs with nothing live in it.
``malloc_trim(0)`` walks every arena and gives back the whole free pages inside them, not only the top of the
main heap. The driver calls :func:`release_free_memory` once an epoch has ended (docs/runtime.md, "Supervised for
months"). Off glibc (musl, macOS) there is no such call and it does nothing.
Airflow-free.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["release_free_memory", "trim_available"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_available() -> bool:
    """Whether this process's C library can give free memory back (glibc's ``malloc_trim``)."""
    return _malloc_trim() is not None


def release_free_memory() -> bool:
    """Give the free pages the C library holds back to the operating system; whether any were given back
    (False off glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
