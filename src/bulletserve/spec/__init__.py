"""Speculative decoding's host side: its settings and the proposers that draft tokens for a
decoding request to verify in one step (the verification is the engine's: engine/speculation.py).
Pure Python, no torch."""
