"""What a latency series is about, as a value: its kind and the process,
stream, dispatcher series and modality it belongs to. A key becomes a
string (`runq_delay{pid=123}`) only to be shown or labelled, and that
string is never parsed back: a dispatcher may name its series or modality
anything, `pid=424242` or `x,modality=vision` included (in the string,
`\\`, `,`, `=`, `{` and `}` of its names are escaped, so that no two keys
read alike). Anomalies carry
the key's fields as a dict (`key`), for the hint policy and whoever reads
them."""

import re
from dataclasses import asdict, dataclass
from functools import lru_cache

RUNQ = "runq_delay"                 # run-queue delay of the threads doing device work
SYNC = "sync_wait"                  # time blocked in a sync call
RETIRE = "submit_to_retire"         # a submission to the sync that covered it
REQUEST = "request_latency"         # a dispatcher's own end-to-end latency
# The kernel streams' series: one process each, gone when it exits.
PER_PROCESS = (RUNQ, SYNC, RETIRE)


@dataclass(frozen=True)
class SeriesKey:
    kind: str
    pid: int | None = None
    stream: int | None = None
    series: str | None = None
    modality: str | None = None

    def __str__(self) -> str:
        return _name(self)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def per_process(self) -> bool:
        return self.kind in PER_PROCESS and self.pid is not None


@lru_cache(maxsize=1024)
def _name(key: SeriesKey) -> str:
    """A key's string, kept for the keys in use: a dispatcher's sample
    (100 a second) names its series twice."""
    if key.kind == REQUEST:
        series, modality = _escaped(key.series), _escaped(key.modality)
        return f"{REQUEST}{{series={series},modality={modality}}}"
    if key.kind == SYNC:
        return f"{SYNC}{{pid={key.pid},stream={key.stream:#x}}}"
    return f"{key.kind}{{pid={key.pid}}}"


_SYNTAX = re.compile(r"([\\,={}])")


def _escaped(value) -> str:
    """A dispatcher's name within a series name: the characters that shape
    the name (\\ , = { }) escaped, so no two keys give one name."""
    return _SYNTAX.sub(r"\\\1", str(value))
