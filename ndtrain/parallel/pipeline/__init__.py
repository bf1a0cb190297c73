"""Pipeline parallelism: the layers cut into chunks over the `pp` ranks, micro-batches
flowing through them by a schedule. Our own implementation on torch.distributed
point-to-point messages. Reading order:

- partition.py   the cut into pp × v chunks, balanced by an explicit cost per layer
- stage.py       this rank's chunks, StageModel, the tied embedding, gathering the stages
- schedules.py   AFAB, 1F1B, interleaved 1F1B, zero bubble, ZB-V and DualPipeV as data: per-rank
                 compute orders
- lists.py       those orders with their messages: the lists that run (`build_schedule`)
- verify.py      proofs on those lists (complete, ordered, deadlock-free); receives posted in time
- simulate.py    the schedule simulator: step time and bubble from F, B, W per chunk and messages
- p2p.py         messages: shapes agreed once per run, buffers, grouped posts
- weightgrad.py  the zero-bubble split of a backward into B (input grad) and W (weights)
- executor.py    PipelineSchedule, the one executor of any list (`run`, `evaluate`)
- timeline.py    every action's start and end, the measured bubble

Kept free of imports here, so the config validator importing partition.py loads no
executor, schedule or messages.
"""
