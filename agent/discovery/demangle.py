"""C++ names in their demangled form, through libstdc++'s __cxa_demangle."""

import ctypes
import ctypes.util
import functools

# Longer mangled names are returned as they are: no real symbol needs more,
# and the demangler's recursion is then bounded whatever a file contains.
MAX_DEMANGLE_INPUT = 16384

# The cache keeps names up to this long only: 65 536 cached names of up to
# MAX_DEMANGLE_INPUT characters could have held a gigabyte for a file full
# of long distinct names; real kernel names are a few hundred characters.
MAX_CACHED_NAME = 1024


# Loaded once per process, as a library handle: what it holds never
# changes an answer.
@functools.cache
def _cxa_demangle():
    """(__cxa_demangle, free) from libstdc++ and libc, or None without them."""
    try:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libstdcxx, "__cxa_demangle")
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_int)]
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return fn, free


def demangle(name: str) -> str:
    """The demangled form of an Itanium C++ ABI name; `name` unchanged when
    it is not one, cannot be demangled, or no libstdc++ is loadable."""
    if isinstance(name, str) and len(name) <= MAX_CACHED_NAME:
        return _demangle_cached(name)
    return _demangle(name)


# Process-wide, and rightly so: it memoises a pure function (a name has one
# demangled form), so what it holds changes no answer, only how fast it comes.
@functools.lru_cache(maxsize=16384)
def _demangle_cached(name: str) -> str:
    return _demangle(name)


def _demangle(name: str) -> str:
    if not isinstance(name, str) or not name.startswith("_Z") or "\0" in name \
            or len(name) > MAX_DEMANGLE_INPUT:
        return name
    api = _cxa_demangle()
    if api is None:
        return name
    fn, free = api
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return name
    status = ctypes.c_int(0)
    ptr = fn(raw, None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        if status.value != 0:
            return name
        return ctypes.string_at(ptr).decode("utf-8", "backslashreplace")
    finally:
        free(ptr)
