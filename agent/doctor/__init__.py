"""`mmtrace doctor`: every prerequisite of tracing, checked by feature."""
