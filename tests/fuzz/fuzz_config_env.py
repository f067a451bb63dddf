"""Fuzz target: bytes as the daemon's environment, one NAME=VALUE a line
(`mmtrace run` reads the MMTRACE_* variables over its file).

The loader either raises MmtraceError (one line, naming the environment)
or returns a config that holds what every loaded config must (the
detectors build, the rings stay within bounds, it passes its own check);
any other exception is a crash."""

import sys

import atheris
import numpy  # noqa: F401  (imported before instrumentation: not ours to fuzz)

with atheris.instrument_imports(include=["mmtrace.agent.config.settings", "mmtrace.agent.config.environment"]):
    from mmtrace.agent.config.environment import load_layers
    from mmtrace.agent.errors import MmtraceError
from fuzz_config import check_loaded


def environment(data: bytes) -> dict[str, str]:
    """What an environment can hold: names without '=', no NUL anywhere."""
    env = {}
    for line in data.decode("utf-8", "replace").split("\n"):
        name, sep, value = line.partition("=")
        if sep and name and "\0" not in line:
            env[name] = value
    return env


def test_one_input(data: bytes):
    try:
        cfg, warnings = load_layers(None, environment(data))
    except MmtraceError as exc:
        if "\n" in exc.message or not exc.message.startswith(("environment: ",
                                                              "the MMTRACE_* variables: ")):
            raise RuntimeError(f"not one line naming the environment: {exc.message!r}") from None
        return
    if any("\n" in w for w in warnings):
        raise RuntimeError(f"a warning of more than one line: {warnings!r}")
    check_loaded(cfg)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
