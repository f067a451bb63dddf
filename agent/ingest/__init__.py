"""From the kernel's records to enriched batches: threads, names, alignment of
submissions with their syncs, latency series and the bounded rings, and the
one ingest path that hands batches to its sinks."""
