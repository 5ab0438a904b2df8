"""In-process MTP speculative decoding: the MTP head and (to come) its engine."""
