"""The in-process dispatcher for inference servers: `Dispatcher`.

Imports nothing of the agent's and neither bcc nor torch, so a server can
use it without root."""

from .dispatcher import DEFAULT_SOCKET, Dispatcher, DispatcherClosed, Shed

__all__ = ["DEFAULT_SOCKET", "Dispatcher", "DispatcherClosed", "Shed"]
