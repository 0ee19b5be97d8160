"""The C library, loaded one way everywhere: :func:`libc`.

``CDLL(None)`` is the libc the interpreter already runs on (no ``find_library``, which
runs ``ldconfig -p``, a process), with ``errno`` kept for ``ctypes.get_errno``. Each call
gives a handle of its own: ``argtypes``/``restype`` set on one handle's functions (say
``syscall`` for ``openat2``) must never change another module's calls through its own.
"""

from __future__ import annotations

import ctypes


def libc() -> ctypes.CDLL:
    """A fresh handle on the running C library, with errno kept."""
    return ctypes.CDLL(None, use_errno=True)
