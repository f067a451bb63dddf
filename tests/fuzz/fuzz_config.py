"""Fuzz target: bytes as the daemon's config file (`mmtrace run --config`).

The loader either raises MmtraceError (one line, no newline in it) or
returns a config from which the detectors build and whose rings stay
within their bounds; any other exception is a crash."""

import functools
import os
import sys
import tempfile

import atheris
import numpy  # noqa: F401  (imported before instrumentation: not ours to fuzz)

with atheris.instrument_imports(include=["mmtrace.agent.config.settings", "tomllib"]):
    from mmtrace.agent.config.settings import check, load_config
    from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.daemon.loop import entropy_detector, p99_detector

MAX_RING_BYTES = 1.3 * 2**30        # both rings at their largest allowed size



def test_one_input(path: str, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
    try:
        cfg = load_config(path)
    except MmtraceError as exc:
        if "\n" in exc.message or not exc.message.startswith(f"config {path}: "):
            raise RuntimeError(f"not one line naming the file: {exc.message!r}") from None
        return
    check_loaded(cfg)


def check_loaded(cfg):
    """What every loaded config must be, whichever layers it came from."""
    p99_detector(cfg.p99)               # the detectors check their settings too
    entropy_detector(cfg.entropy)
    if cfg.ring_capacity * 48 + cfg.device_ring_capacity * 224 > MAX_RING_BYTES:
        raise RuntimeError(f"rings too large: {cfg.ring_capacity}, {cfg.device_ring_capacity}")
    if check(cfg) != cfg:
        raise RuntimeError("a loaded config does not pass its own check")


if __name__ == "__main__":
    fd, config_path = tempfile.mkstemp(prefix="fuzz-config-", suffix=".toml")
    os.close(fd)
    atheris.Setup(sys.argv, functools.partial(test_one_input, config_path))
    atheris.Fuzz()
