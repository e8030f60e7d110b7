"""Speculative decoding: drafters (n-gram now; DSpark with the [dspark] issue) and the verify plan."""
