"""In-process MTP speculative decoding: the head, its loader, its decoder and engine."""
