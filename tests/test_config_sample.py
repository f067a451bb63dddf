"""The sample configuration shipped for systemd loads and matches the defaults."""

from dataclasses import asdict
from pathlib import Path

from mmtrace.agent.config import DaemonConfig, load_config

SAMPLE = Path(__file__).resolve().parent.parent / "systemd" / "mmtrace.toml"


def test_sample_config_is_the_defaults():
    assert asdict(load_config(SAMPLE)) == asdict(DaemonConfig())
