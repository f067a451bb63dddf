"""The messages explain's code gives (made for the CLI, and the daemon's
replies made by the same code) in the words of the MCP tool's arguments:
`window`, not `--window`; the last seconds when no window was given."""

import re

_FLAG = re.compile(r"(?<![\w-])--(window|pid)\b")
_OUTSIDE = re.compile(r"--window ([0-9.]+:[0-9.]+ s) is outside")


def in_tool_terms(message: str, window_given: bool) -> str:
    # the daemon's reply names its request again: said once is enough
    message = message.replace("refused the explain request: explain: ",
                              "refused the explain request: ")
    if not window_given:
        message = _OUTSIDE.sub(r"the last last_s seconds (\1) are outside", message)
    return _FLAG.sub(r"\1", message)
