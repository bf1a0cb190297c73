"""One generator process of asynchronous RL (`python -m ndtrain.train.rl.generator HOST PORT`,
started by train/rl/asynchronous.py with the socket's key in its environment).

It holds one whole model and the frozen reference (the first weights it receives), and
samples its rollouts of the schedule in order: rollout t with the weights of rollout
version_of(t) (`rl.async_weights = fixed`), or with the newest it holds, at least those
(`newest`), waiting for them if they have not come yet. A thread receives every message
as it comes (so the trainer's send takes only the copy), keeping the newest weights of each
version it still needs: a notice on the socket, then the weights themselves over the weight
bridge (`parallel/weight_bridge.receive`, from each pipeline stage's sender rank) into a
shadow state that becomes visible only whole, so sampling never sees half a version. A
rollout is sampled and scored exactly as the synchronous job does it on one rank
(`RL.sample_rounds`, `rollout.generate_everywhere` on a one-process layout):
each row's completion is a function of its prompt, seed and the weights, so it is the same
wherever it is drawn. It reports how long it waited for weights (idle) and how long it
sampled (busy). Waiting longer than `rl.exchange_timeout_s`, or the trainer's connection
closing, ends it with one line on stderr and a non-zero status.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Client
from types import SimpleNamespace

import torch

from ndtrain.config import from_dict
from ndtrain.model.llama import Transformer
from ndtrain.parallel import weight_bridge
from ndtrain.parallel.precision import compute_dtype
from ndtrain.train.rl.asynchronous import KEY_ENV, owner_of, version_of
from ndtrain.train.rl.rollout import generate_everywhere, generate_in_segments


class _Alone:
    """A one-process generation layout for `generate_everywhere`: every row is this
    process's, nothing is gathered."""

    active, size = False, 1

    def __init__(self, device: torch.device):
        self.ranks = (0, 1)
        self.tp = self.world = self
        self.mesh = SimpleNamespace(device=device)


class Inbox:
    """Messages from the trainer, read by a thread as they come: on the notice of a version,
    its weights from the bridge (every parameter into a fresh state, made visible whole)."""

    def __init__(self, conn, groups: dict, entries: list, timeout: float):
        self.conn, self.groups, self.entries, self.timeout = conn, groups, entries, timeout
        self.weights, self.closed, self.failed, self.received = {}, False, None, 0
        self.ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except Exception:  # closed, or unreadable: the generator stops
                message = ("stop",)
            state = failed = None
            if message[0] == "weights":
                try:
                    state = weight_bridge.receive(self.groups, self.entries, self.timeout)
                except weight_bridge.BridgeError as e:
                    failed = f"the weights of rollout {message[1]} did not come over the weight bridge: {e}"
            with self.ready:
                if state is not None:
                    self.weights[message[1]] = state
                    self.received += 1
                else:
                    self.closed, self.failed = True, failed
                self.ready.notify_all()
            if state is None:
                return

    def wait(self, version: int, timeout: float, newest: bool = False, keep: int | None = None):
        """(the weights of `version`, or with `newest` of the newest version at or after it;
        None if stopped or timed out, that version, whether the trainer stopped). Versions
        older than the returned one (or than `keep`, when given) are dropped; the returned
        one stays (the next rollout may use it again)."""
        with self.ready:
            self.ready.wait_for(lambda: any(v >= version if newest else v == version for v in self.weights)
                                or self.closed, timeout)
            held = [v for v in self.weights if (v >= version if newest else v == version)]
            chosen = max(held) if held else version
            for v in [v for v in self.weights if v < (chosen if keep is None else keep)]:
                del self.weights[v]
            return self.weights.get(chosen), chosen, self.closed

    def linger(self) -> None:
        """After the last rollout: keep taking what the trainer still sends (under `newest`
        it sends every version, and a send to a process that left would fail) until it stops,
        its connection closes, or nothing comes for the limit."""
        with self.ready:
            while not self.closed:
                count = self.received
                self.weights.clear()
                if not self.ready.wait_for(lambda: self.closed or self.received != count, self.timeout):
                    return


def serve(conn) -> int:
    from ndtrain.train.rl.task import RL, Environment

    setup = pickle.loads(conn.recv_bytes())
    cfg, args, g = from_dict(setup["cfg"]), setup["args"], setup["generator"]
    rank = setup["world"] + g
    torch.set_num_threads(setup["threads"])
    bridge = _join_bridge(setup, rank)
    if bridge is None:
        return 1
    device = torch.device("cpu" if setup["device"] == "cpu" else
                          f"cuda:{(setup['world'] + g) % max(1, torch.cuda.device_count())}")
    task = RL(cfg, Environment(cfg, setup["template"]))
    dtype = compute_dtype(cfg.train.precision, cfg.train.fp8_base)
    model = Transformer(args).to(device=device, dtype=dtype).requires_grad_(False)
    model.reset_rope(device)
    reference = None
    inbox = Inbox(conn, bridge, weight_bridge.plan(args, cfg), setup["timeout"])
    start, total, k, n = setup["start"], setup["total"], setup["staleness"], setup["generators"]
    t_ = cfg.train
    template = task.env.template
    newest, continued = cfg.rl.async_weights == "newest", cfg.rl.partial_rollout == "continue"
    held = Held(model, inbox, setup["timeout"], newest)
    for t in range(start, total):
        if owner_of(t, start, n) != g:
            continue
        waits, began, segments = [0.0], time.time(), []
        try:
            v, idle = held.take(version_of(t, start, k))
            segments.append(v)
            ready = time.time()
            if reference is None:
                reference = copy.deepcopy(model)
            t1 = time.perf_counter()

            def segment_weights(j: int) -> tuple:
                """Partial rollouts: segment j's weights, those of min(v + j, t) (fixed) or the
                newest held (newest); the generation waits for them as for a rollout's first."""
                if j == 0:
                    if held.version != v:  # a later round (DAPO's refills) starts again on the rollout's weights
                        held.take(v, keep=v, exact=True)
                    return model, v
                vj, waited = held.take(held.version if newest else min(v + j, t), keep=v)
                waits[0] += waited
                segments.append(vj)
                return model, vj

            def generate(rows, prompts, seeds):
                score = lambda i, ids: task.env.score(rows[i], ids)[:4]  # noqa: E731
                if continued:
                    return generate_in_segments(segment_weights, cfg.rl.partial_tokens, prompts, seeds, task.sampling,
                                                template.stop_ids, template.pad_id, score, reference, t_.micro_batch,
                                                t_.loss_chunk)
                return generate_everywhere(model, _Alone(device), prompts, seeds, task.sampling, template.stop_ids,
                                           template.pad_id, score, reference, t_.micro_batch, t_.loss_chunk)
            rounds, kept = task.sample_rounds(t, generate)
            idle += waits[0]
            message = {"index": t, "version": v, "rounds": rounds, "kept": kept, "idle_s": idle,
                       "busy_s": time.perf_counter() - t1 - waits[0], "times": (began, ready, time.time()),
                       "segments": segments}
        except NoWeights as e:
            if inbox.failed is not None:
                print(f"ndtrain rl: generator rank {rank}: {inbox.failed}; exiting", file=sys.stderr, flush=True)
                return 1
            if e.closed:
                return 0
            print(f"ndtrain rl: generator rank {rank}: no weights of rollout {e.version} (for rollout {t}) from the "
                  f"trainer within {setup['timeout']:g} s (rl.exchange_timeout_s); exiting", file=sys.stderr, flush=True)
            return 1
        except Exception as e:  # the trainer says it in one line and stops
            message = {"index": t, "error": str(e) if isinstance(e, WeightsLacking) else f"{type(e).__name__}: {e}"}
        try:
            conn.send_bytes(pickle.dumps(message, protocol=5))
        except OSError:
            return 0  # the trainer is gone
        if "error" in message:
            return 1
    inbox.linger()
    return 0


def _join_bridge(setup: dict, rank: int) -> dict | None:
    """This generator's weight-bridge groups, by pipeline stage; None (and one line) if one
    could not be made."""
    g = setup["generator"]
    made = weight_bridge.join(tuple(setup["bridge"]), [(s, g) for s in range(setup["stages"])], 1,
                              setup["timeout"], setup["join_limit"])
    broken = next((why for why in made.values() if isinstance(why, str)), None)
    if broken is not None:
        print(f"ndtrain rl: generator rank {rank}: could not join the weight bridge within "
              f"{setup['join_limit']:g} s: {broken}; exiting", file=sys.stderr, flush=True)
        return None
    return {s: group for (s, _), group in made.items()}


class Held:
    """The model's weights: which version it holds, and taking another from the inbox."""

    def __init__(self, model, inbox: Inbox, timeout: float, newest: bool):
        self.model, self.inbox, self.timeout, self.newest = model, inbox, timeout, newest
        self.version = None

    def take(self, version: int, keep: int | None = None, exact: bool = False) -> tuple:
        """The weights of `version` (newest, unless `exact`: the newest at or after it) loaded
        into the model; (its version, seconds waited). Raises NoWeights, or WeightsLacking."""
        t0 = time.perf_counter()
        state, v, closed = self.inbox.wait(version, self.timeout, self.newest and not exact, keep)
        if state is None:
            raise NoWeights(v, closed)
        waited = time.perf_counter() - t0
        if v != self.version:
            params = dict(self.model.named_parameters())
            missing = [n for n in self.model.load_state_dict(state, strict=False).missing_keys if n in params]
            if missing:  # sampling from weights the trainer did not send would be silently wrong
                raise WeightsLacking(f"the trainer's weights lack {missing[:3]}")
            self.version = v
        return v, waited


class NoWeights(Exception):
    def __init__(self, version: int, closed: bool):
        super().__init__(version)
        self.version, self.closed = version, closed


class WeightsLacking(Exception):
    pass


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop(KEY_ENV)))
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
