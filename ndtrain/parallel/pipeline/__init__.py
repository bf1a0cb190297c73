"""Pipeline parallelism (see executor.py)."""
