"""The daemon's side of the loop: the hint policy fed from what the daemon
sees (see policy_inputs), the hints it issues counted by kind, and its
audit log in a form status replies and flight recordings carry."""

import logging
import time
from collections import Counter, deque

from mmtrace.dispatch.policy import HintPolicy, PolicySettings
from mmtrace.exporters.live import status as status_view

from mmtrace.agent.daemon.cpu_load import CpuLoad
from mmtrace.agent.daemon.policy_inputs import PolicyInputs

log = logging.getLogger("mmtrace.daemon")

AUDIT_IN_STATUS = 16
HINT_FIELDS = ("id", "kind", "target", "value", "ttl_s", "reason", "issued_ns")


class Steering:
    def __init__(self, settings: PolicySettings, *, hint_id, cpu: CpuLoad | None = None,
                 clock=time.monotonic_ns):
        self.inputs = PolicyInputs(cpu, clock)
        self.policy = HintPolicy(settings, hint_id=hint_id)
        self.issued: Counter = Counter()         # kind -> hints issued (dry-run issues none)
        self.sent: Counter = Counter()           # kind -> deliveries to dispatchers
        self.recent: deque[dict] = deque(maxlen=status_view.MAX_HINTS)   # for status replies

    @property
    def dry_run(self) -> bool:
        return self.policy.settings.dry_run

    def step(self, now_ns: int) -> list[dict]:
        """The hints to send now."""
        hints = self.policy.decide(self.inputs.observations(now_ns))
        self.issued.update(h["kind"] for h in hints)
        return hints

    def deliver(self, now_ns: int, server, scope) -> None:
        """Send what the policy decides now through `server` (if any): each
        hint to the processes `scope(hint)` names, or to every subscriber
        when it names none. Dry-run sends nothing; the audit log has every
        decision."""
        for hint in self.step(now_ns):
            self.recent.append({k: hint[k] for k in HINT_FIELDS})
            log.warning("hint %s %s -> %s: %s", hint["kind"], hint["target"], hint["value"],
                        hint["reason"])
            if server is not None:
                pids = scope(hint)
                sent = server.broadcast(hint) if pids is None else server.send_to(pids, hint)
                self.sent[hint["kind"]] += sent

    @property
    def hints_sent(self) -> int:
        return sum(self.sent.values())

    def audit(self, last: int | None = None) -> list[dict]:
        """The audit log, oldest first (the last `last` entries)."""
        entries = list(self.policy.audit)
        return entries[-last:] if last else entries

    def summary(self) -> dict:
        return {"dry_run": self.dry_run, "issued": dict(self.issued),
                "outcomes": {f"{kind}/{outcome}": n
                             for (kind, outcome), n in sorted(self.policy.counts.items())},
                # without the evidence, which flight recordings keep: status stays small
                "audit": [{k: v for k, v in e.items() if k != "evidence"}
                          for e in self.audit(AUDIT_IN_STATUS)]}
