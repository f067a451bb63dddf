"""What the BPF compiler said. bcc prints clang's diagnostics to the
process's stderr and raises only "Failed to compile BPF module"; the
reason an operator needs (which line, which error) is in the text. While
a program compiles, file descriptor 2 goes to a temporary file; afterwards
the text is passed on to the real stderr unchanged (nothing is lost, but
what other threads log meanwhile comes out after the compile), and its
error lines are kept for the error message."""

import contextlib
import os
import re
import tempfile

MAX_ERRORS = 3
_ERROR_LINE = re.compile(r"^(?:\S+:\d+:\d+: )?(?:fatal )?error: .*$", re.M)


class Diagnostics:
    text = ""

    def errors(self) -> str:
        """The first MAX_ERRORS error lines, joined; '' when there are none."""
        return "; ".join(_ERROR_LINE.findall(self.text)[:MAX_ERRORS])


@contextlib.contextmanager
def captured():
    diagnostics = Diagnostics()
    try:
        sink = tempfile.TemporaryFile()
        saved = os.dup(2)
    except OSError:                 # no room for the file: compile without capture
        yield diagnostics
        return
    with sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield diagnostics
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            raw = sink.read()
            if raw:
                with contextlib.suppress(OSError):
                    os.write(2, raw)
            diagnostics.text = raw.decode("utf-8", "replace")
