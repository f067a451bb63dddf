"""Which files to probe: ELF symbols, the processes' /proc maps, and where a
process's libraries were loaded. Pure Python: nothing here loads eBPF."""
