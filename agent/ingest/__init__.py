"""From the kernel's records to enriched batches: threads, names, alignment of
submissions with their syncs, latency series and the bounded rings, the
one ingest path that hands batches to its sinks, and where its loops sleep
(wakeups)."""
