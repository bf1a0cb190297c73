"""Collectives with byte accounting (`ops`), the counters themselves (`stats`) and the group
every collective is called on (`group`)."""
