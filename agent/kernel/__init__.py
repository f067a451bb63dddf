"""The kernel side: compiling and loading the eBPF programs, the ring reader,
uprobe links and the load-time layout check. The only place that imports bcc."""
