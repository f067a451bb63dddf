"""The hint socket: the dispatchers' samples and entropy in, hints out, and
what they report kept for recordings."""
