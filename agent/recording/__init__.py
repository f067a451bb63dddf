"""The recording file (format, checks), replay in time order, the report, the
detectors over a recording, exports' plumbing, the flight recorder and
`mmtrace record`."""
