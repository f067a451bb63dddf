"""One finding of `mmtrace doctor` (or of a part that checks its own
ground, as discovery does): what was checked, whether it holds, and the fix."""

from dataclasses import asdict, dataclass


@dataclass
class Check:
    name: str
    ok: bool
    required: bool
    detail: str
    fix: str = ""

    def as_dict(self):
        return asdict(self)
