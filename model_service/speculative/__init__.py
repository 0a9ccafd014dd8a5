"""Speculative decoding: drafters (n-gram, draft model) and the verification rule."""
