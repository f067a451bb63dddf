"""The eBPF programs, one per stream, each beside the Python that decodes it."""

from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent


def source(name: str) -> str:
    """Text of one program or header shipped in this package."""
    return (SOURCE_DIR / name).read_text()
