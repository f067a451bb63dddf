"""Configuration: defaults, the TOML file, MMTRACE_* environment variables and
flags, put in that order and checked once."""
