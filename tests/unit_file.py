"""systemd/mmtrace.service read the way the tests need it."""

from pathlib import Path

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "mmtrace.service"


def service_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """[Service] settings, each name with its values in order."""
    out: dict[str, list[str]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            name, _, value = line.partition("=")
            out.setdefault(name, []).append(value)
    return out


def comments(path: Path = UNIT) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
