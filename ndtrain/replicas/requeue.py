"""run.lost_rows = "requeue": the rows a lost replica group missed are trained later, by a
live group, instead of being skipped (docs/faults.md).

A part is (step, replica group): that group's share of that step's global batch. Every live
rank holds the same queue of parts not trained yet, oldest first, because it changes only
with what every rank agreed on (the lighthouse's quorums):
- at a step's first quorum (joiners included), the i-th member by replica number takes the
  i-th oldest queued part on top of its own rows (`assign`): its micro-batches are its own
  and then that part's (under pipeline parallelism, one run of the group's schedule over
  all of them: 2m micro-batches), and the step's target count is the live groups' total,
  so the loss is the mean over every row the step trained;
- once the step committed over the groups `used`, the parts it did not train go to the
  queue (`settle`): the own part of each group missing from `used`, and the queued part a
  group that died during the step had taken (back to the front, where it was);
- a joiner receives the queue with the state (the source writes it to the lighthouse's
  store beside the quorum that admits it);
- at the run's last step the parts still queued are dropped, and counted as skipped.
The queue is in checkpoints (meta.json's `lost_rows_queue`; ReplicaRun.checkpoint_extra).
"""

from __future__ import annotations

Part = tuple[int, int]  # (step, replica group)


class Requeue:
    def __init__(self, replicas: int):
        self.replicas = replicas
        self.queue: list[Part] = []
        self.plan: dict[int, Part] = {}  # replica → the queued part it trains at this step

    def assign(self, members: list[int]) -> None:
        self.plan = dict(zip(sorted(members), self.queue))

    def extra(self, replica: int) -> Part | None:
        return self.plan.get(replica)

    def settle(self, step: int, used: list[int]) -> dict:
        """The queue after `step` committed over the groups `used`; returns the step's
        metrics: `requeued` (the parts put in the queue) and `from_queue` (the queued parts
        the step trained, by the groups in `used` in order)."""
        taken = [self.plan[r] for r in sorted(self.plan)]
        trained = [self.plan[r] for r in sorted(self.plan) if r in used]
        back = [p for p in taken if p not in trained]
        missed = [(step, r) for r in range(self.replicas) if r not in used]
        self.queue = back + self.queue[len(taken):] + missed
        self.plan = {}
        return {"requeued": [list(p) for p in back + missed], "from_queue": [list(p) for p in trained]}

    def encode(self) -> str:
        return ";".join(f"{s}:{r}" for s, r in self.queue)

    def decode(self, text: str) -> None:
        self.queue = [tuple(int(x) for x in p.split(":")) for p in text.split(";") if p]
