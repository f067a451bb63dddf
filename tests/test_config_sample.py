"""The sample configuration shipped for systemd loads, matches the defaults
and names every setting."""

import re
from dataclasses import asdict, fields
from pathlib import Path

from mmtrace.agent.config.settings import SECTIONS, DaemonConfig, load_config

SAMPLE = Path(__file__).resolve().parent.parent / "systemd" / "mmtrace.toml"


def test_sample_config_is_the_defaults():
    assert asdict(load_config(SAMPLE)) == asdict(DaemonConfig())


def test_sample_config_shows_every_setting():
    """Each key, commented out or set, so that the sample documents them all."""
    text = SAMPLE.read_text()
    sections = {"": DaemonConfig, **SECTIONS}
    for section, cls in sections.items():
        body = text.split(f"[{section}]\n")[1].split("\n[")[0] if section else \
            text.split("\n[")[0]
        for f in fields(cls):
            if f.name in SECTIONS:
                continue
            assert re.search(rf"^#? ?{f.name} = ", body, re.M), f"[{section}] {f.name}"
