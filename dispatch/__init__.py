"""The in-process dispatcher for inference servers: `Dispatcher`.

Imports nothing of the agent's and neither bcc nor torch, so a server can
use it without root. The dispatcher itself (and asyncio with it) is
imported on first use: the agent imports only the hint policy and the
duration checks from here."""

import importlib

__all__ = ["DEFAULT_SOCKET", "Dispatcher", "DispatcherClosed", "Shed"]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module(".dispatcher", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
