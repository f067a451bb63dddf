"""Which device a request runs on: session affinity, device weights, and
the imbalance override.

- A session's requests go to the device that holds its state: the device
  its first request was placed on, for as long as the session is
  remembered (the latest `max_sessions`, or until `forget(session)`).
- A new session, or a request without one, goes by smooth weighted round
  robin over the devices its modality may use: with weights 3 and 1, three
  of every four placements go to the first device. Without weights every
  device weighs the same (plain round robin). Devices weighing 0 are left
  out unless every candidate weighs 0.
- Imbalance override: when the device the weights chose has at least
  `imbalance_abs` more requests queued or running than the least loaded
  candidate, and at least `imbalance_rel` times as many, the new session
  goes to the least loaded candidate instead. Sessions already placed stay
  where their state is.
"""

from collections import OrderedDict

DEFAULT_IMBALANCE_ABS = 8
DEFAULT_IMBALANCE_REL = 2.0
DEFAULT_MAX_SESSIONS = 65536


class Placement:
    def __init__(self, devices: list[str], *, imbalance_abs: int = DEFAULT_IMBALANCE_ABS,
                 imbalance_rel: float = DEFAULT_IMBALANCE_REL, max_sessions: int = DEFAULT_MAX_SESSIONS):
        if not isinstance(imbalance_abs, int) or imbalance_abs < 1:
            raise ValueError(f"imbalance_abs: expected an integer >= 1, got {imbalance_abs!r}")
        if not isinstance(imbalance_rel, (int, float)) or not imbalance_rel >= 1:
            raise ValueError(f"imbalance_rel: expected a number >= 1, got {imbalance_rel!r}")
        self.devices = list(devices)
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = float(imbalance_rel)
        self.max_sessions = max_sessions
        self.load = {d: 0 for d in self.devices}
        self.sessions: OrderedDict = OrderedDict()
        self.overrides = 0
        self._credit = {d: 0.0 for d in self.devices}

    def place(self, session, weights: dict[str, float], allowed: list[str] | None = None) -> str:
        if session is not None:
            device = self.sessions.get(session)
            if device is not None:
                self.sessions.move_to_end(session)
                return device
        candidates = allowed or self.devices
        device = self._by_weight(candidates, weights)
        least = min(candidates, key=self.load.__getitem__)
        mine, low = self.load[device], self.load[least]
        if mine - low >= self.imbalance_abs and mine >= self.imbalance_rel * low:
            device = least
            self.overrides += 1
        if session is not None:
            self.sessions[session] = device
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return device

    def forget(self, session) -> bool:
        return self.sessions.pop(session, None) is not None

    def _by_weight(self, candidates: list[str], weights: dict[str, float]) -> str:
        positive = [d for d in candidates if weights.get(d, 1.0) > 0] or candidates
        if len(positive) == 1:
            return positive[0]
        credit = self._credit
        total = 0.0
        for d in positive:
            w = weights.get(d, 1.0) or 1.0
            credit[d] += w
            total += w
        best = max(positive, key=credit.__getitem__)
        credit[best] -= total
        return best
