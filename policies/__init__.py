"""Routing policy: which decoding plan serves each request and round."""
