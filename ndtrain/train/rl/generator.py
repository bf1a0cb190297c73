"""One generator process of asynchronous RL (`python -m ndtrain.train.rl.generator HOST PORT`,
started by train/rl/asynchronous.py with the socket's key in its environment).

It holds one whole model and the frozen reference (the first weights it receives), and
samples its rollouts of the schedule in order: rollout t with the weights of rollout
version_of(t) (`rl.async_weights = fixed`), or with the newest it holds, at least those
(`newest`), waiting for them if they have not come yet. A thread receives every message
as it comes (so the trainer's send takes only the copy), keeping the newest weights of each
version it still needs. A rollout is sampled and scored exactly as the synchronous job does
it on one rank (`RL.sample_rounds`, `rollout.generate_everywhere` on a one-process layout):
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
from ndtrain.parallel.precision import compute_dtype
from ndtrain.train.rl.asynchronous import KEY_ENV, owner_of, version_of
from ndtrain.train.rl.rollout import generate_everywhere


class _Alone:
    """A one-process generation layout for `generate_everywhere`: every row is this
    process's, nothing is gathered."""

    active, size = False, 1

    def __init__(self, device: torch.device):
        self.ranks = (0, 1)
        self.tp = self.world = self
        self.mesh = SimpleNamespace(device=device)


class Inbox:
    """Messages from the trainer, read by a thread as they come."""

    def __init__(self, conn):
        self.conn, self.weights, self.closed = conn, {}, False
        self.ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except Exception:  # closed, or unreadable: the generator stops
                message = ("stop",)
            with self.ready:
                if message[0] == "weights":
                    self.weights[message[1]] = message[2]
                else:
                    self.closed = True
                self.ready.notify_all()
            if message[0] != "weights":
                return

    def wait(self, version: int, timeout: float, newest: bool = False):
        """(the weights of `version`, or with `newest` of the newest version at or after it;
        None if stopped or timed out, that version, whether the trainer stopped). Older
        versions are dropped; the returned one stays (the next rollout may use it again)."""
        with self.ready:
            self.ready.wait_for(lambda: any(v >= version if newest else v == version for v in self.weights)
                                or self.closed, timeout)
            held = [v for v in self.weights if (v >= version if newest else v == version)]
            chosen = max(held) if held else version
            for v in [v for v in self.weights if v < chosen]:
                del self.weights[v]
            return self.weights.get(chosen), chosen, self.closed


def serve(conn) -> int:
    from ndtrain.train.rl.task import RL, Environment

    setup = pickle.loads(conn.recv_bytes())
    cfg, args, g = from_dict(setup["cfg"]), setup["args"], setup["generator"]
    rank = setup["world"] + g
    torch.set_num_threads(setup["threads"])
    device = torch.device("cpu" if setup["device"] == "cpu" else
                          f"cuda:{(setup['world'] + g) % max(1, torch.cuda.device_count())}")
    task = RL(cfg, Environment(cfg, setup["template"]))
    dtype = compute_dtype(cfg.train.precision, cfg.train.fp8_base)
    model = Transformer(args).to(device=device, dtype=dtype).requires_grad_(False)
    model.reset_rope(device)
    reference = None
    inbox = Inbox(conn)
    start, total, k, n = setup["start"], setup["total"], setup["staleness"], setup["generators"]
    t_ = cfg.train
    template = task.env.template
    for t in range(start, total):
        if owner_of(t, start, n) != g:
            continue
        t0 = time.perf_counter()
        state, v, closed = inbox.wait(version_of(t, start, k), setup["timeout"], cfg.rl.async_weights == "newest")
        if state is None:
            if closed:
                return 0
            print(f"ndtrain rl: generator rank {rank}: no weights of rollout {v} (for rollout {t}) from the trainer "
                  f"within {setup['timeout']:g} s (rl.exchange_timeout_s); exiting", file=sys.stderr, flush=True)
            return 1
        idle = time.perf_counter() - t0
        params = dict(model.named_parameters())
        missing = [n for n in model.load_state_dict(state, strict=False).missing_keys if n in params]
        if missing:  # sampling from weights the trainer did not send would be silently wrong
            conn.send_bytes(pickle.dumps({"index": t, "error": f"the trainer's weights lack {missing[:3]}"}))
            return 1
        if reference is None:
            reference = copy.deepcopy(model)
        t1 = time.perf_counter()

        def generate(rows, prompts, seeds):
            return generate_everywhere(model, _Alone(device), prompts, seeds, task.sampling, template.stop_ids,
                                       template.pad_id, lambda i, ids: task.env.score(rows[i], ids)[:4],
                                       reference, t_.micro_batch, t_.loss_chunk)
        try:
            rounds, kept = task.sample_rounds(t, generate)
            message = {"index": t, "version": v, "rounds": rounds, "kept": kept, "idle_s": idle,
                       "busy_s": time.perf_counter() - t1}
        except Exception as e:  # the trainer says it in one line and stops
            message = {"index": t, "error": f"{type(e).__name__}: {e}"}
        try:
            conn.send_bytes(pickle.dumps(message, protocol=5))
        except OSError:
            return 0  # the trainer is gone
        if "error" in message:
            return 1
    return 0


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop(KEY_ENV)))
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
