"""Tearing kernel attachments down side by side. Releasing a uprobe link
or a tracepoint's program waits for an RCU grace period (50-80 ms each
here); one after another, a daemon with a few dozen of them took 2-3 s to
stop. The calls release the GIL while they wait, so from several threads
the waits overlap."""

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

log = logging.getLogger("mmtrace.probes")

MAX_THREADS = 16


def close_all(closers: Iterable[Callable[[], object]], what: str) -> None:
    """Call every closer, side by side where there are several; a failure
    is logged (naming `what`) and the others still run."""
    closers = list(closers)

    def one(close):
        try:
            close()
        except Exception as exc:  # bcc raises bare Exception
            log.warning("a %s did not detach cleanly: %s", what, exc)

    if len(closers) <= 1:
        for close in closers:
            one(close)
        return
    with ThreadPoolExecutor(min(MAX_THREADS, len(closers)),
                            thread_name_prefix="mmtrace-detach") as pool:
        list(pool.map(one, closers))
