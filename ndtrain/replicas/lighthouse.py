"""The lighthouse: how replica groups agree, step by step, on which of them are alive, and
on whether what they exchanged arrived (run.fault_tolerance = "replicas", docs/faults.md).

Every rank of every replica group is a client of one TCPStore, hosted by the parent that
watches them (replicas/launch.py). The parent writes what only it knows: each replica's
incarnation (`ft/inc/R`, bumped at each restart) and which incarnations died
(`ft/down/R/I`). The ranks write the rest, and never overwrite a decision: the first
proposal of a key wins (`compare_set`), and every rank reads the winner.

- A quorum, one per (tag, attempt): the replicas that take part, and the joiners (restarted
  replicas admitted now, which first receive the state from a live peer). A replica takes
  part if it was in this rank's last committed quorum and its incarnation is not down; a
  joiner if every rank of its new incarnation said it is ready. Joiners enter only at
  attempt 0, before anything of the step was computed.
- Each quorum has one gloo process group per position inside a replica group (the ranks
  with the same coordinates in every replica group), made from the store on first use and
  kept while the membership stays the same.
- A phase: an exchange over those groups. Every rank writes its outcome (ok, or the
  exception it met); the phase's decision, commit or retry, is proposed by the first rank
  that sees every outcome of a replica not down (or one failure) and read by all. A retry
  is a new attempt with a new quorum, once the parent has marked a member down (or a
  heartbeat period has passed).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from ndtrain import supervisor

POLL_S = 0.005


@dataclass(frozen=True)
class Quorum:
    key: str  # the (tag, attempt) it was agreed for
    group_id: str  # its process groups' name: the same while the membership stays the same
    members: tuple[tuple[int, int], ...]  # (replica, incarnation), joiners included, by replica
    joiners: tuple[tuple[int, int], ...]

    @property
    def replicas(self) -> list[int]:
        return [r for r, _ in self.members]

    @property
    def source(self) -> int:
        """The replica that sends the state to joiners: the first one that is not joining."""
        return next(r for r, i in self.members if (r, i) not in self.joiners)

    def encode(self) -> str:
        pairs = (lambda xs: ",".join(f"{r}:{i}" for r, i in xs))
        return f"{self.group_id};{pairs(self.members)};{pairs(self.joiners)}"

    @classmethod
    def decode(cls, key: str, text: str) -> "Quorum":
        gid, members, joiners = text.split(";")
        pairs = (lambda s: tuple(tuple(int(x) for x in p.split(":")) for p in s.split(",") if p))
        return cls(key, gid, pairs(members), pairs(joiners))


def environment() -> dict | None:
    """This rank's place among the replica groups, as the parent set it (None: no replicas)."""
    if "NDTRAIN_REPLICA" not in os.environ:
        return None
    e = os.environ
    return {"replica": int(e["NDTRAIN_REPLICA"]), "replicas": int(e["NDTRAIN_REPLICAS"]),
            "incarnation": int(e["NDTRAIN_REPLICA_INCARNATION"]), "port": int(e["NDTRAIN_LIGHTHOUSE_PORT"])}


class Lighthouse:
    """One rank's client of the lighthouse. `position`: its rank inside its replica group
    (the same coordinates in every group); `positions`: the ranks of a group."""

    def __init__(self, replica: int, replicas: int, incarnation: int, port: int, position: int, positions: int,
                 heartbeat_s: float, host: str = "127.0.0.1"):
        self.replica, self.replicas, self.incarnation = replica, replicas, incarnation
        self.position, self.positions, self.heartbeat_s = position, positions, heartbeat_s
        # A wait on a peer ends when the parent marks it down (heartbeat_s after it went
        # silent at most) or, failing that, after this bound.
        self.timeout = datetime.timedelta(seconds=2 * heartbeat_s + 30)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        # The first incarnation starts with every replica group; a restarted one joins.
        self.last = tuple((r, 0) for r in range(replicas)) if incarnation == 0 else ()
        self.group_id = "start"
        self._groups: dict[str, object] = {}  # group_id → this position's process group (None alone)
        self._old: list = []  # groups of past quorums, kept: a gloo group torn down mid-failure can block
        self._tried: set[str] = set()  # a joiner's admissions whose transfer failed
        self._written: list[list[str]] = []  # this rank's outcome keys, per quorum it took part in

    @property
    def joining(self) -> bool:
        return not self.last

    # -- what the parent wrote ------------------------------------------------------
    def incarnation_of(self, r: int) -> int:
        return int(self.store.get(f"ft/inc/{r}"))

    def down(self, r: int, inc: int) -> bool:
        return self.store.check([f"ft/down/{r}/{inc}"])

    # -- quorums ----------------------------------------------------------------------
    def quorum(self, tag: str, attempt: int, admit: bool = True) -> Quorum:
        """The quorum of (tag, attempt), proposed by this rank if it is the first to ask;
        `admit`: whether restarted groups may join now."""
        key = f"ft/q/{tag}/{attempt}"
        if not self.store.check([key]):
            self.store.compare_set(key, "", self._propose(tag, attempt, admit).encode())
        q = Quorum.decode(key, self.store.get(key).decode())
        for r, inc in q.joiners:  # tell the joiner where to come (every reader writes the same)
            self.store.set(f"ft/admit/{r}/{inc}", key)
        return q

    def _propose(self, tag: str, attempt: int, admit: bool) -> Quorum:
        members = [(r, i) for r, i in self.last if not self.down(r, i)]
        joiners = []
        if attempt == 0 and admit:
            for r in range(self.replicas):
                inc = self.incarnation_of(r)
                if (r, inc) in self.last or self.down(r, inc):
                    continue
                ready = [f"ft/ready/{r}/{inc}/{p}" for p in range(self.positions)]
                if self.store.check(ready):
                    joiners.append((r, inc))
        if not members:  # every member is down: the proposer's own replica is dying too
            members = [(self.replica, self.incarnation)]
        everyone = tuple(sorted(members + joiners))
        same = attempt == 0 and not joiners and everyone == self.last
        return Quorum(f"ft/q/{tag}/{attempt}", self.group_id if same else f"{tag}.{attempt}", everyone,
                      tuple(joiners))

    def await_change(self, failed: Quorum) -> None:
        """Before a retry: wait until the parent marks a member of the failed quorum down,
        or a heartbeat period passes (a failure nobody died of: retry as it was)."""
        deadline = time.monotonic() + self.heartbeat_s
        while time.monotonic() < deadline:
            if any(self.down(r, i) for r, i in failed.members if r != self.replica):
                return
            supervisor.heartbeat()
            time.sleep(POLL_S * 10)

    def admission(self) -> Quorum:
        """A joiner: say every rank of this incarnation is ready, then wait for the quorum
        that admits it (the latest attempt naming it). Beats meanwhile."""
        self.store.set(f"ft/ready/{self.replica}/{self.incarnation}/{self.position}", "1")
        admit = f"ft/admit/{self.replica}/{self.incarnation}"
        while True:
            supervisor.heartbeat()
            if self.store.check([admit]):
                key = self.store.get(admit).decode()
                tag, attempt = key.rsplit("/", 1)
                while self.store.check([f"{tag}/{int(attempt) + 1}"]):  # a later attempt of that step exists
                    attempt = str(int(attempt) + 1)
                key = f"{tag}/{attempt}"
                if key not in self._tried:
                    self._tried.add(key)  # one try each: a failed transfer waits for the next admission
                    q = Quorum.decode(key, self.store.get(key).decode())
                    if (self.replica, self.incarnation) in q.joiners:
                        return q
            time.sleep(POLL_S * 4)

    def group(self, q: Quorum):
        """This position's process group of quorum `q` (None when it has one member)."""
        if q.group_id not in self._groups:
            if len(self._groups) > 0:
                self._old += list(self._groups.values())
                self._groups.clear()
            pg = None
            if len(q.members) > 1:
                prefix = dist.PrefixStore(f"ft/pg/{q.group_id}/{self.position}", self.store)
                pg = dist.ProcessGroupGloo(prefix, q.replicas.index(self.replica), len(q.members), self.timeout)
            self._groups[q.group_id] = pg
        return self._groups[q.group_id]

    # -- phases -----------------------------------------------------------------------
    def phase(self, q: Quorum, name: str, exchange) -> bool:
        """Run `exchange(group)` over this position's group of `q`, then agree with every
        rank of the quorum whether the phase committed (True) or must be retried (False)."""
        try:
            with supervisor.beating():  # blocked on a peer, this rank is still alive
                exchange(self.group(q))
            outcome = "1"
        except (RuntimeError, dist.DistError) as e:  # a peer died or hung: gloo's errors
            outcome = "0" + str(e).splitlines()[0][:200] if str(e) else "0"
        key = f"{q.key}/{name}/{self.replica}/{self.position}"
        self.store.set(key, outcome)
        if not self._written or not self._written[-1][0].startswith(q.key + "/"):
            self._written.append([])
        self._written[-1].append(key)
        self._forget()
        return self.decision(q, name)

    def _forget(self) -> None:
        """Delete this rank's outcomes of quorums two or more before the current one: every
        rank that read them has decided since (a quorum's phases need every live rank's
        outcome, written after it decided the quorum before), so the store stays small."""
        while len(self._written) > 2:
            for key in self._written.pop(0):
                self.store.delete_key(key)

    def decision(self, q: Quorum, name: str) -> bool:
        key = f"{q.key}/{name}/decision"
        while not self.store.check([key]):
            view = self._view(q, name)
            if view is not None:
                self.store.compare_set(key, "", view)
                break
            supervisor.heartbeat()
            time.sleep(POLL_S)
        committed = self.store.get(key) == b"1"
        if committed:
            self.last, self.group_id = q.members, q.group_id
        return committed

    def _view(self, q: Quorum, name: str) -> str | None:
        """"1": every replica not down committed at every position; "0": one failed; None:
        outcomes still missing."""
        complete = True
        for r, inc in q.members:
            keys = [f"{q.key}/{name}/{r}/{p}" for p in range(self.positions)]
            if self.down(r, inc):
                continue
            for k in keys:
                if not self.store.check([k]):
                    complete = False
                elif not self.store.get(k).startswith(b"1"):
                    return "0"
        return "1" if complete else None
