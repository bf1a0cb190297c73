"""Collectives with byte accounting (`ops`) and the counters themselves (`stats`)."""
