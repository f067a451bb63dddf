"""bcc's module of a compiled program goes once every function is loaded
(agent/kernel/compiled_module.py): its tables go on being read and written
through descriptors of their own, what it never held is refused cleanly,
and a function that does not load keeps the module."""

import os
import subprocess
import sys
import textwrap

import pytest

from mmtrace.agent.kernel import compiled_module

pytestmark = pytest.mark.bpf

PROGRAM = r"""
BPF_ARRAY(hits, u64, 4);
int tracepoint__sched__sched_process_exec(void *ctx) {
    int k = 0; u64 *v = hits.lookup(&k); if (v) __sync_fetch_and_add(v, 1); return 0;
}
int on_call(struct pt_regs *ctx) { return 0; }
"""


@pytest.fixture
def program():
    from bcc import BPF
    bpf = BPF(text=PROGRAM)
    owned = compiled_module.own_tables(bpf)
    yield bpf, owned
    bpf.cleanup()
    compiled_module.close_owned(owned)


def refuse(name):
    raise RuntimeError(f"{name} refused")


def test_a_function_that_does_not_load_keeps_the_module(program):
    bpf, _ = program
    assert not compiled_module.drop_module(bpf, refuse)
    assert bpf.module
    assert b"on_call" not in bpf.funcs
    bpf.load_func(b"on_call", bpf.KPROBE)       # the module still serves it


def test_the_module_goes_and_its_tables_stay_readable_and_writable(program):
    bpf, owned = program
    hits = bpf["hits"]
    hits[hits.Key(1)] = hits.Leaf(7)
    assert compiled_module.drop_module(bpf, lambda name: bpf.load_func(name.encode(),
                                                                        bpf.KPROBE))
    assert not bpf.module
    assert set(bpf.funcs) == {b"tracepoint__sched__sched_process_exec", b"on_call"}
    # The tracepoint still runs and counts into the map, read through our descriptor.
    subprocess.run(["/bin/true"], check=True)
    assert bpf["hits"][hits.Key(0)].value >= 1
    assert bpf["hits"][hits.Key(1)].value == 7
    assert bpf[b"hits"] is bpf["hits"]
    hits[hits.Key(2)] = hits.Leaf(3)
    assert hits[hits.Key(2)].value == 3
    # What the module never held is refused, not read from a freed module.
    with pytest.raises(KeyError):
        bpf["missing"]
    with pytest.raises(Exception, match="Unknown program"):
        bpf.load_func(b"not_there", bpf.KPROBE)
    assert hits.map_fd in owned


def test_owned_descriptors_are_closed_once(program):
    bpf, owned = program
    fds = list(owned)
    assert fds and all(os.fstat(fd) for fd in fds)
    compiled_module.close_owned(owned)
    assert owned == []
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    compiled_module.close_owned(owned)      # twice: nothing left to close


def test_the_daemons_split_load_drops_both_modules_and_closes_what_it_owned():
    """The daemon's way: the scheduler program alone, the GPU/NPU programs
    compiled after it on its exported maps (found through the scheduler's
    module, dropped once they are wired); one split load per process, so in
    a process of its own."""
    script = textwrap.dedent("""
        import os
        from mmtrace.agent.kernel import probes
        loaded = probes.load_cpu(probes.ProbeOptions(), compile_apart=True)
        assert loaded.bpf.module, "kept: the GPU/NPU programs find its exported maps through it"
        loaded.compile_device()
        assert not loaded.device_program.module and loaded.bpf.module
        loaded.load_device()
        assert not loaded.bpf.sched.module and not loaded.bpf.device.module
        assert loaded.counters()
        loaded.learn_threads({os.getpid(): os.getpid()})
        threads = loaded.bpf["threads"]
        assert threads[threads.Key(os.getpid())].tgid == os.getpid()
        loaded.read()
        fds = list(loaded.owned_fds)
        loaded.close()
        still_open = []
        for fd in fds:
            try:
                os.fstat(fd)
                still_open.append(fd)
            except OSError:
                pass
        assert not still_open, still_open
        print("ok", len(fds))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok ")


def test_a_table_that_cannot_be_held_is_said_and_leaves_no_descriptor(monkeypatch):
    import errno
    from bcc import BPF
    from mmtrace.agent.errors import MmtraceError
    bpf = BPF(text=PROGRAM + "BPF_HASH(second, u32, u64);")
    made, real_dup = [], os.dup

    def dup_once(fd):
        if made:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        made.append(real_dup(fd))
        return made[-1]
    monkeypatch.setattr(compiled_module.os, "dup", dup_once)
    try:
        with pytest.raises(MmtraceError, match=r"the eBPF map \w+ could not be held: Too many "
                                               r"open files .*RLIMIT_NOFILE"):
            compiled_module.own_tables(bpf)
        with pytest.raises(OSError):
            os.fstat(made[0])           # the one it held is closed again
    finally:
        bpf.cleanup()


def test_programs_that_cannot_be_readied_for_want_of_descriptors_say_so_and_free_the_module():
    """DeviceCompile's thread: an OSError (EMFILE, while compiling or holding
    the tables) becomes one line naming the limit; the scheduler's module,
    kept for the GPU/NPU programs, goes since they will not come."""
    import errno
    from mmtrace.agent.kernel.device_compile import DeviceCompile

    class Loaded:
        dropped = 0

        def compile_device(self):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        def load_device(self):
            raise AssertionError("not wired after a failed compile")

        def drop_scheduler_module(self):
            self.dropped += 1

    loaded = Loaded()
    compiling = DeviceCompile(loaded)
    compiling.thread.join(10)
    error = compiling.finish()
    assert "the GPU/NPU programs could not be readied: Too many open files" in str(error)
    assert "RLIMIT_NOFILE" in str(error)
    assert loaded.dropped == 1
