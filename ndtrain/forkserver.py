"""Imported by the fork server only, first (supervisor.py and testing.py name it in the
server's preload): the server ignores SIGTERM, the processes it forks do not.

`timeout`, systemd, SLURM's `scancel` and Kubernetes stop a job with SIGTERM to its whole
process group, the fork server included. Python's fork server ignores SIGINT but not
SIGTERM: killed, it takes with it the pipe through which the parent learns its ranks' exit
codes, and a rank that then saves its checkpoint and reports reads as "exited with code 255
without a report". Ignoring it here, the server lives until the parent closes its end of
the server's pipe (the parent exiting, however it exits). Each process it forks starts with
SIGTERM's default again; a rank then sets its own handler (supervisor._rank_main).
"""

import os
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
