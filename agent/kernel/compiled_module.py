"""bcc's module of a compiled program, dropped once nothing needs it.

bcc's Python binding creates its modules with the "rw engine" on, and a
module with it keeps LLVM's context and the JIT's copy of every compiled
section for its whole life: 15-16 MB of the daemon's heap for each of its
two programs, resident for as long as the probes run. The kernel needs
none of it once the programs are loaded; bcc's Python object asks the
module only to look a table up by name (bpf_table_fd and its type
descriptions) and to load a function (bpf_function_start).

So: every table is fetched as soon as the program compiles, each on a
descriptor of its own (`own_tables`; the module's descriptors close with
it), and once every function is loaded, the module is destroyed
(`drop_module`). Afterwards a table or function the module held but was
not fetched cannot be had; bcc then raises KeyError and "Unknown
program" rather than reading a freed module (its C entry points check
for a null module).
"""

import ctypes
import logging
import os
from typing import Callable

from mmtrace.agent import heap
from mmtrace.agent.errors import os_failure

log = logging.getLogger(__name__)


def _libbcc():
    from bcc import libbcc
    lib = libbcc.lib
    # Not declared by bcc's binding: a size_t index in, a C string out.
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    return lib


def table_names(program) -> list[str]:
    lib = _libbcc()
    return [lib.bpf_table_name(program.module, i).decode()
            for i in range(lib.bpf_num_tables(program.module))]


def function_names(program) -> list[str]:
    lib = _libbcc()
    return [lib.bpf_function_name(program.module, i).decode()
            for i in range(lib.bpf_num_functions(program.module))]


def own_tables(program) -> list[int]:
    """Fetch every table of a bcc program now, each reading its map through
    a descriptor of its own; returns those descriptors, which the caller
    closes after the program's cleanup (bcc's cleanup does not)."""
    owned = []
    try:
        for name in table_names(program):
            table = program[name]
            try:
                table.map_fd = os.dup(table.map_fd)
            except OSError as exc:
                raise os_failure(f"the eBPF map {name} could not be held", exc) from None
            owned.append(table.map_fd)
            program.tables[name.encode()] = table    # bcc's own calls ask by bytes
    except BaseException:
        close_owned(owned)
        raise
    return owned


def close_owned(fds: list[int]):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def drop_module(program, load: Callable[[str], None]) -> bool:
    """Load every function of `program` not loaded yet (`load(name)`, as its
    attacher will ask for it), then destroy bcc's module and hand malloc's
    freed pages back. Its tables must be owned (own_tables) first. A
    function that does not load keeps the module, so that it fails as it
    did before, when attached. Returns whether the module went."""
    if program is None or not program.module:
        return False
    for name in function_names(program):
        if name.encode() in program.funcs:
            continue
        try:
            load(name)
        except Exception as exc:    # bcc's bare Exception: the verifier said no
            log.info("bcc's module kept: program %s did not load (%s)", name, exc)
            return False
    _libbcc().bpf_module_destroy(program.module)
    program.module = None
    heap.trim()
    return True
