"""Attach planned probes to their file, and detach them.

Two ways to attach, chosen by what the kernel supports (agent/kernel/probes.py
compiles the programs of one of them):
- "multi" (Linux 6.6+): the symbols of a library that share a decoder are
  one uprobe_multi link, each symbol's API id in its cookie. Removing a
  uprobe costs an RCU grace period (about 0.1 s on a VM); a link of any
  size costs one, so switching the per-launch probes or closing takes a
  few grace periods per library, not one per symbol (hundreds of aclnn ops);
  links closed together are closed from several threads, so their grace
  periods overlap.
- "single": one uprobe per symbol through bcc, with a program per symbol;
  the aclnn ops still get a cookie each through a perf link (5.15+), or
  else are named by address in userspace.
"""

import logging
import os
import resource

from mmtrace.agent.kernel.concurrent_close import close_side_by_side
from mmtrace.agent.kernel.probed_file import ATTACHED, DETACHED, FAILED, RETURN, Probe
from mmtrace.agent.kernel.uprobe_link import (BPF_TRACE_UPROBE_MULTI, BPF_TRACE_UPROBE_SESSION,
                                              CookieLink, LinkError, UprobeMultiLink)

log = logging.getLogger(__name__)

MULTI, SINGLE = "multi", "single"
# bcc refuses more than 1000 open probes per process unless told otherwise.
PROBE_LIMIT = 1 << 16


class BccUprobe:
    """A uprobe bcc attached; close() detaches it."""
    descriptors = 1     # bcc's perf event

    def __init__(self, bpf, ev_name: bytes):
        self.bpf, self.ev_name = bpf, ev_name

    def close(self):
        if self.ev_name is not None:
            self.bpf.detach_uprobe_event(self.ev_name)
            self.ev_name = None


class ProbeAttacher:
    """Attaches probes to the programs of one loaded bcc object, in one mode;
    with `sessions` (multi mode, programs compiled for them), the per-launch
    probes as uprobe sessions, whose entries choose which returns run."""

    def __init__(self, bpf, mode: str, sessions: bool = False):
        self.bpf, self.mode, self.sessions = bpf, mode, sessions

    def load(self, fn_name: str, session: bool = False):
        """The program `fn_name`, loaded as this mode attaches it (bcc keeps
        it by name: a second ask returns the first load)."""
        from bcc import BPF
        if self.mode == MULTI:
            return self.bpf.load_func(fn_name.encode(), BPF.KPROBE,
                                      attach_type=BPF_TRACE_UPROBE_SESSION if session
                                      else BPF_TRACE_UPROBE_MULTI)
        return self.bpf.load_func(fn_name.encode(), BPF.KPROBE)

    def _session(self, probe: Probe) -> bool:
        return self.sessions and probe.api.per_launch and probe.point != RETURN

    def _multi_fn(self, probe: Probe) -> str:
        return probe.api.session_fn if self._session(probe) else probe.multi_fn

    def attach(self, probes: list[Probe]):
        """Attach `probes`; each one's state and reason say how it went."""
        if self.mode == MULTI:
            self._attach_multi(probes)
        else:
            for probe in probes:
                self._attach_single(probe)

    def detach(self, probes: list[Probe], reason: str):
        """Detach `probes`; a link shared with probes not listed stays (only
        probes of one library share a link)."""
        leaving = set(probes)
        libraries = {id(p.library): p.library for p in probes}.values()
        staying = {id(p.attachment) for library in libraries for p in library.probes
                   if p not in leaving and p.attachment is not None}
        close_side_by_side([attachment for attachment in
                            {id(p.attachment): p.attachment for p in probes
                             if p.attachment is not None}.values()
                            if id(attachment) not in staying])
        for probe in probes:
            probe.attachment = None
            if probe.state == ATTACHED:
                probe.state, probe.reason = DETACHED, reason

    def _attach_multi(self, probes: list[Probe]):
        groups: dict[tuple, list[Probe]] = {}
        for p in probes:
            groups.setdefault((id(p.library), self._multi_fn(p), p.point, p.api.per_launch),
                              []).append(p)
        for group in groups.values():
            first = group[0]
            fn_name = self._multi_fn(first)
            try:
                fn = self.load(fn_name, session=self._session(first))
            except Exception as exc:    # bcc's bare Exception: the program did not load
                log.warning("program %s for %d symbols of %s not loaded: %s", fn_name,
                            len(group), first.library.path, exc)
                for p in group:
                    p.state, p.reason = FAILED, attach_failure(exc)
                continue
            self._link(fn.fd, group)
            failed = [p for p in group if p.state == FAILED]
            if failed:
                log.warning("%d of %d %s probes of %s not attached: %s",
                            len(failed), len(group), first.point, first.library.path,
                            "; ".join(f"{p.symbol}: {p.reason}" for p in failed[:5]))

    def _link(self, prog_fd: int, group: list[Probe]):
        """One link for the group. The kernel refuses a whole link for one
        offset it cannot probe: then halves, so that only the symbols at
        fault fail (a few more links, not one per symbol)."""
        first = group[0]
        try:
            link = UprobeMultiLink(prog_fd, first.library.attach_path,
                                   [p.offset for p in group], [p.cookie for p in group],
                                   retprobe=first.point == RETURN, session=self._session(first))
        except LinkError as exc:
            if len(group) == 1:
                first.state, first.reason = FAILED, attach_failure(exc)
                return
            half = len(group) // 2
            self._link(prog_fd, group[:half])
            self._link(prog_fd, group[half:])
            return
        for p in group:
            p.attachment, p.state, p.reason = link, ATTACHED, ""

    def _attach_single(self, probe: Probe):
        if probe.api.pattern is not None:
            try:
                fn = self.load(probe.single_fn)
                probe.attachment = CookieLink(fn.fd, probe.library.attach_path, probe.offset,
                                              probe.cookie, retprobe=probe.point == RETURN)
                probe.state, probe.reason = ATTACHED, ""
                return
            except (LinkError, OSError) as exc:
                # Named by address in userspace instead, while the process lives.
                log.info("uprobe %s:%s attached without a cookie: %s", probe.library.path,
                         probe.symbol, exc)
        before = set(self.bpf.uprobe_fds)
        attach = self.bpf.attach_uretprobe if probe.point == RETURN else self.bpf.attach_uprobe
        try:
            attach(name=probe.library.attach_path, addr=probe.vaddr,
                   fn_name=probe.single_fn.encode())
        except Exception as exc:  # bcc raises bare Exception, with the cause on stderr
            probe.state, probe.reason = FAILED, attach_failure(exc)
            log.warning("uprobe %s:%s (%s) not attached: %s", probe.library.path,
                        probe.symbol, probe.point, probe.reason)
            return
        added = set(self.bpf.uprobe_fds) - before
        probe.attachment = BccUprobe(self.bpf, added.pop()) if added else None
        probe.state, probe.reason = ATTACHED, ""


def attach_failure(exc: Exception) -> str:
    text = exc.strerror if isinstance(exc, LinkError) and exc.strerror else str(exc)
    if "quota" in text:
        return f"{text} (BCC_PROBE_LIMIT)"
    return text or type(exc).__name__


def raise_limits(probes: int):
    """One perf event descriptor per probe when attached one by one: lift
    bcc's probe quota and the soft descriptor limit to what they need."""
    need = max(probes + 64, PROBE_LIMIT)
    current = os.environ.get("BCC_PROBE_LIMIT", "")
    if not current.isdigit() or int(current) < need:
        os.environ["BCC_PROBE_LIMIT"] = str(need)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = probes + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit to %d (%s): some probes may "
                        "fail with EMFILE", target, exc)
