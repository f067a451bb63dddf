"""Log lines the journal can filter: where stderr is the journal's stream
(JOURNAL_STREAM names its device and inode), every line starts with its
syslog priority `<N>`; anywhere else the plain format stays."""

import os
import re
import subprocess
import sys

import pytest

from mmtrace.agent.daemon.log_format import priority

PROGRAM = """
import logging
from mmtrace.agent.daemon import log_format
log_format.configure("debug")
log = logging.getLogger("mmtrace.daemon")
log.debug("looking")
log.info("tracing: all")
log.warning("anomaly p99")
log.error("cannot write")
log.critical("gone")
try:
    raise ValueError("bad")
except ValueError:
    log.exception("failed")
"""


def run_logging(tmp_path, journal_stream=None) -> list[str]:
    """The program's stderr lines, stderr being a file; with journal_stream
    a function of that file's stat giving JOURNAL_STREAM."""
    path = tmp_path / "stderr"
    with open(path, "w") as err:
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        if journal_stream is not None:
            env["JOURNAL_STREAM"] = journal_stream(os.fstat(err.fileno()))
        subprocess.run([sys.executable, "-c", PROGRAM], stderr=err, env=env, check=True,
                       timeout=60)
    return path.read_text().splitlines()


def test_the_journal_gets_each_line_with_its_priority(tmp_path):
    lines = run_logging(tmp_path, lambda st: f"{st.st_dev}:{st.st_ino}")
    assert lines[:5] == ["<7>DEBUG mmtrace.daemon: looking",
                         "<6>INFO mmtrace.daemon: tracing: all",
                         "<4>WARNING mmtrace.daemon: anomaly p99",
                         "<3>ERROR mmtrace.daemon: cannot write",
                         "<2>CRITICAL mmtrace.daemon: gone"]
    # A traceback is one entry per line to the journal: each keeps the record's priority.
    assert lines[5] == "<3>ERROR mmtrace.daemon: failed"
    assert len(lines) > 7 and all(line.startswith("<3>") for line in lines[5:])
    assert lines[-1] == "<3>ValueError: bad"


@pytest.mark.parametrize("stream", [None, lambda st: f"{st.st_dev}:{st.st_ino + 1}",
                                    lambda st: "garbage"])
def test_anywhere_else_the_plain_format_stays(tmp_path, stream):
    lines = run_logging(tmp_path, stream)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(stamp + r" DEBUG mmtrace\.daemon: looking", lines[0]), lines[0]
    assert re.fullmatch(stamp + r" WARNING mmtrace\.daemon: anomaly p99", lines[2]), lines[2]
    assert not any(line.startswith("<") for line in lines)


def test_priorities_follow_syslog():
    assert [priority(n) for n in (50, 40, 30, 20, 10, 25, 5)] == [2, 3, 4, 6, 7, 6, 7]
