"""Speculative decoding: proposers guess tokens, one target pass verifies them all."""
