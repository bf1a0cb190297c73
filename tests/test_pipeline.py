"""Pipeline parallelism: schedules as data, equality with one process (the layout matrix has
more rows), agreement with torch.distributed.pipelining, activation memory, tied embeddings,
checkpoints, the trace, and bad input."""

import inspect

import pytest
import torch

from helpers import TINY, assert_losses_close, assert_states_close, train_in_rank
from ndtrain.parallel.pipeline.partition import balanced_counts, chunk_counts, layer_costs, local_chunks, owner
from ndtrain.parallel.pipeline.lists import _align_receives, build_schedule, for_async_messages, with_messages
from ndtrain.parallel.pipeline.schedules import COMPUTE, SCHEDULES, Action, compute_orders, message_id, parts, vshape
from ndtrain.parallel.pipeline.simulate import bubble, compute_parts, simulate, theory_bubble, timeline
from ndtrain.parallel.pipeline.verify import ScheduleError, check_deadlock_free, check_links, verify
from ndtrain.testing import run_ranks


# --------------------------------------------------------------------------- schedules as data

def _shapes():
    for name in SCHEDULES:
        for pp in (2, 3, 4, 8):
            for v in ((1, 2, 3) if name == "interleaved" else (2,) if vshape(name) else (1,)):
                for m in range(1, 3 * pp + 1):
                    if (name != "interleaved" or m % pp == 0) and (name != "dualpipev" or m >= 2 * pp):
                        yield name, pp, v, m


def test_every_schedule_is_complete_ordered_and_deadlock_free():
    """Each (chunk, micro-batch) computed once per kind on its owner, after what it takes
    from its own rank, both ends of every link agree on the order, and no rank can wait
    forever even if every message is a rendezvous."""
    count = 0
    for name, pp, v, m in _shapes():
        for train in (True, False):
            verify(build_schedule(name, pp, v, m, train=train), pp, v, m, train=train, v_shape=vshape(name))
            count += 1
    assert count > 400


def test_v_placement():
    """A V: rank r holds chunks r and 2p−1−r; the turn and both ends stay on one rank."""
    assert [local_chunks(r, 4, 2, True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [owner(c, 4, True) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [owner(c, 4) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    lists = build_schedule("zbv", 2, 2, 4)
    kinds = {a.kind for a in lists[1] if a.chunk == 2 and a.kind.startswith(("send", "recv"))}
    assert kinds == {"send_F", "recv_B"}  # chunk 2 takes its input from chunk 1, on the same rank


def test_receives_move_only_to_meet_their_sends():
    """ZB-V's cool-down, with each receive just before its consumer, deadlocks if messages
    are rendezvous (two neighbours each send first); `build_schedule` posts the receives it
    needs earlier, and nothing else moves."""
    naive = _align_receives(with_messages(compute_orders("zbv", 4, 2, 8), 8, 4, True), 4, True)
    with pytest.raises(ScheduleError, match="deadlock"):
        check_deadlock_free(naive, 4, True)
    built = build_schedule("zbv", 4, 2, 8)
    for before, after in zip(naive, built):
        assert sorted(map(str, before)) == sorted(map(str, after))
        assert [a for a in before if not a.kind.startswith("recv")] == [a for a in after if not a.kind.startswith("recv")]
    assert built != naive


def _runs_with_async_messages(lists: list[list], pp: int) -> bool:
    """Run the lists as the executor does on gloo: posting never blocks; a compute action
    waits until every message it consumes was posted by its sender. True if all finish."""
    at, sent, posted = [0] * pp, set(), [set() for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(lists):
            while at[r] < len(actions):
                a = actions[at[r]]
                if a.kind in COMPUTE:
                    needs = {message_id(Action("recv_" + p.kind, p.chunk, p.micro)) for p in parts(a) if p.kind != "W"}
                    if any(n in posted[r] and n not in sent for n in needs):
                        break
                elif a.kind.startswith("send"):
                    sent.add(message_id(a))
                else:
                    posted[r].add(message_id(a))
                at[r] += 1
                progress = True
    return all(at[r] == len(actions) for r, actions in enumerate(lists))


def test_async_lists_post_early_and_change_no_order():
    """On gloo the executor runs `for_async_messages` of each verified list: receives a
    compute action early. The compute order and the order of every link's messages stay as
    verified, each message is received before its consumer, and the lists run when posting
    never blocks."""
    count = moved = 0
    for name, pp, v, m in _shapes():
        for train in (True, False):
            lists = build_schedule(name, pp, v, m, train=train)
            early = [for_async_messages(a) for a in lists]
            check_links(early, pp, vshape(name))
            for before, after in zip(lists, early):
                assert [a for a in before if not a.kind.startswith("recv")] == \
                    [a for a in after if not a.kind.startswith("recv")]
                assert [a for a in before if a.kind.startswith("recv")] == [a for a in after if a.kind.startswith("recv")]
                where = {}  # the position of each message and compute part (an F&B's two at its place)
                for k, a in enumerate(after):
                    for p in parts(a):
                        where.setdefault((p.kind, p.chunk, p.micro), k)
                for a in after:  # each receive before its consumer
                    if a.kind.startswith("recv"):
                        assert where[(a.kind, a.chunk, a.micro)] < where[(a.kind[-1], a.chunk, a.micro)]
                moved += [str(a) for a in before] != [str(a) for a in after]
            assert _runs_with_async_messages(early, pp), (name, pp, v, m, train)
            count += 1
    assert count > 400 and moved > 400
    # the check can fail: a receive consumed before anyone sends it never runs
    assert not _runs_with_async_messages([[], [Action("recv_F", 1, 0), Action("F", 1, 0)]], 2)


def test_verifier_catches_a_deadlock_and_a_misordered_link():
    """Negative controls for the checks above."""
    good = build_schedule("1f1b", 2, 1, 4)
    swapped = [list(good[0]), list(good[1])]
    first = next(k for k, a in enumerate(swapped[1]) if a.kind == "recv_F")
    second = next(k for k, a in enumerate(swapped[1]) if a.kind == "recv_F" and k > first)
    swapped[1][first], swapped[1][second] = swapped[1][second], swapped[1][first]
    with pytest.raises(ScheduleError, match="link 0→1"):
        verify(swapped, 2, 1, 4)
    # rank 1 sends its first gradient before receiving anything: a cycle under rendezvous
    stuck = [list(good[0]), [a for a in good[1] if a.kind != "recv_F"]]
    stuck[1].insert(0, next(a for a in good[1] if a.kind == "recv_F"))
    backwards = [a for a in stuck[1] if a.kind in ("B", "send_B")]
    stuck[1] = [a for a in stuck[1] if a.kind not in ("B", "send_B")]
    stuck[1][1:1] = backwards[:2]
    with pytest.raises(ScheduleError):
        verify(stuck, 2, 1, 4)
    # a V's turn: chunk 4 (rank 3) run before chunk 3 (rank 3) gave it its input
    v = build_schedule("zbv", 4, 2, 8)
    turn = [a for a in v[3] if a.kind == "F" and a.micro == 0]
    assert [a.chunk for a in turn] == [3, 4]
    i, j = v[3].index(turn[0]), v[3].index(turn[1])
    v[3][i], v[3][j] = v[3][j], v[3][i]
    with pytest.raises(ScheduleError, match="before F0.c3, its input"):
        verify(v, 4, 2, 8, v_shape=True)


@pytest.mark.parametrize("name, v", [("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zbv", 2),
                                     ("dualpipev", 2)])
def test_simulated_bubble_equals_theory(name, v):
    """With unit costs (F = 1, whole backward = 2; split: F = B = W = 1) and free messages the
    lists give exactly the textbook bubble: zero bubble a third of 1F1B's, DualPipeV the same
    as ZB-H1 ((p−1)(F&B + B − 3W) over 2p chunks), ZB-V half of that."""
    for pp in (2, 4):
        for m in (2 * pp, 4 * pp, 8 * pp):
            split = name in ("zb", "zbv", "dualpipev")
            f, b, w = (1, 1, 1) if split else (1, 2, 0)
            got = simulate(build_schedule(name, pp, v, m), f, b, w)[1]
            assert got == pytest.approx(theory_bubble(name, pp, v, m), abs=1e-12), (pp, m)
            if split:
                third = theory_bubble("1f1b", pp, 1, m) / 3
                assert got == pytest.approx(third / 2 if name == "zbv" else third)
    # DualPipe's formula with unequal costs (F ≤ B): (p−1)(F + 2B − W) of idle per rank
    for f, b, w in ((1, 2, 1), (1, 1, 0.5), (0.5, 1.5, 0.5)):
        got = simulate(build_schedule("dualpipev", 4, 2, 16), f, b, w)[1]
        assert got == pytest.approx(theory_bubble("dualpipev", 4, 2, 16, f, b, w), abs=1e-12)


def test_v_schedules_hold_what_their_papers_say():
    """Peak activations per rank, in chunk-micro-batches (half a stage each): ZB-V 2p, i.e. the
    p whole micro-batches of 1F1B's first stage; DualPipeV 2p + 1 (DualPipe's PP + 1)."""
    for name, extra in (("zbv", 0), ("dualpipev", 1)):
        for pp in (2, 4):
            for r, ticks in enumerate(compute_orders(name, pp, 2, 4 * pp)):
                actions = [a for tick in ticks for a in tick]
                split = {(a.chunk, a.micro) for a in actions if a.kind == "W"}
                held = peak = 0
                for a in actions:
                    held += (a.kind == "F") - (a.kind == "W" or (a.kind == "B" and (a.chunk, a.micro) not in split))
                    peak = max(peak, held)
                assert peak == 2 * pp + extra, (name, pp, r)


def test_simulator_on_synthetic_costs():
    """simulate(lists, f, b, w, p2p): per-chunk costs, messages that take time, whole and
    split backwards, overlapped pairs. Hand-worked: 1F1B, 2 stages, 2 micro-batches, F = 1,
    whole B = 2, each message 0.5: stage 1 runs F0 [1.5, 2.5] B0 [2.5, 4.5] F1 [4.5, 5.5]
    B1 [5.5, 7.5]; stage 0 F0 [0, 1] F1 [1, 2] B0 [5, 7] B1 [8, 10]: 10 s, each rank idle 4
    of its 6 busy."""
    step, idle = simulate(build_schedule("1f1b", 2, 1, 2), 1.0, 2.0, 0.0, p2p=0.5)
    assert step == pytest.approx(10.0) and idle == pytest.approx(4 / 6)
    # per chunk: a stage twice as slow sets the pace of the steady phase: (m + 1)·3 + 3 for 1F1B, p = 2
    step, _ = simulate(build_schedule("1f1b", 2, 1, 8), [1.0, 2.0], [2.0, 4.0], 0.0)
    assert step == pytest.approx(3 + 8 * 6)
    # a split backward costs b, its W w; a whole one b + w: ZB-H1 with W = 0 is 1F1B with B = b
    assert simulate(build_schedule("zb", 4, 1, 8), 1, 2, 0)[0] == simulate(build_schedule("1f1b", 4, 1, 8), 1, 2, 0)[0]
    # an F&B costs its forward plus its backward unless `overlap` says otherwise: hiding the
    # shorter half shortens DualPipeV's step
    lists = build_schedule("dualpipev", 2, 2, 8)
    plain, _ = simulate(lists, 1, 1, 1)
    hidden, _ = simulate(lists, 1, 1, 1, overlap=max)
    assert plain == pytest.approx(2 * 8 * 3 + 2) and hidden < plain
    # messages delay only what waits for them: a 0-cost rendezvous-free list is the same
    assert simulate(lists, 1, 1, 1, p2p=0.0)[0] < simulate(lists, 1, 1, 1, p2p=0.25)[0]
    ranks = timeline(lists, lambda r, a: 1.0)
    assert bubble(ranks) >= 0 and len(ranks) == 2


def test_replayed_bubble_separates_durations_from_the_executor():
    """Replaying a timeline through the schedule with its own durations and free messages:
    equal durations give the theory; one slow action on the critical path raises the replay,
    because it is a property of the durations, not of the messages."""
    from ndtrain.observe.trace import replayed_bubble
    from ndtrain.parallel.pipeline.timeline import Event
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        plan = build_schedule(name, 2, v, 8)
        sim = compute_parts(timeline(plan, lambda r, a: {"F": 1.0, "B": 2.0, "FB": 3.0}[a.kind]))
        ranks = [[Event(a.kind, a.chunk, a.micro, s, e) for a, s, e in rank] for rank in sim]
        assert replayed_bubble(ranks, name, 2, v, 8) == pytest.approx(theory_bubble(name, 2, v, 8))
        slow = ranks[1][0]  # the last stage's first forward takes three times as long
        ranks[1][0] = Event(slow.kind, slow.chunk, slow.micro, slow.start, slow.start + 3 * (slow.end - slow.start))
        assert replayed_bubble(ranks, name, 2, v, 8) > theory_bubble(name, 2, v, 8) * 1.25


def test_the_trace_simulates_a_step_from_its_own_costs():
    """`ndtrain trace`'s prediction: a timeline made by the simulator with known per-chunk
    costs (idle time recorded as waits, as the executor records them) gives back those costs
    (chunk_costs: whole and split backwards told apart, as DualPipeV mixes them) and
    exactly its own step time."""
    from ndtrain.observe.trace import chunk_costs, measured_step, simulated_step
    from ndtrain.parallel.pipeline.simulate import action_costs
    from ndtrain.parallel.pipeline.timeline import Event
    for name, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2), ("dualpipev", 2)):
        f, b, w = [1.0, 1.5, 1.25, 2.0][:2 * v], [2.0, 1.0, 1.5, 1.75][:2 * v], [0.5, 0.75, 1.0, 0.25][:2 * v]
        if name in ("1f1b", "interleaved"):
            w = [0.0] * len(w)
        plan = build_schedule(name, 2, v, 8)
        rules = [action_costs(f, b, w, defer=True)(actions) for actions in plan]  # as the executor runs
        sim = compute_parts(timeline(plan, lambda r, a: rules[r](a)), lambda r, a: f[a.chunk])
        ranks = []
        for rank in sim:
            events = [Event(a.kind, a.chunk, a.micro, s, e) for a, s, e in rank]
            idle = [Event("wait_F", x.chunk, x.micro, x.end, y.start) for x, y in zip(events, events[1:]) if y.start > x.end]
            ranks.append(events + idle)
        got_f, got_b, got_w, post = chunk_costs(ranks, 2 * v)
        if name in ("zb", "dualpipev"):  # the first chunk's split backwards are deferred: B nothing, W whole
            b, w = [0.0] + b[1:], [b[0] + w[0]] + w[1:]
        assert got_f == pytest.approx(f) and got_b == pytest.approx(b) and got_w == pytest.approx(w) and post == 0
        step, _ = simulated_step(ranks, name, 2, v, 8)
        assert step == pytest.approx(measured_step(ranks), rel=1e-12), name


def test_deferred_backwards_are_those_nobody_reads_before_their_w():
    """lists.deferred: a split backward whose input gradient is neither sent nor used by the
    chunk before it until its W runs: the first chunk's everywhere, and in ZB-V the turn
    chunk's (its gradient stays on the last rank); never one whose gradient another rank waits
    for. Simulated as the executor runs them (B free, W whole), they can only shorten the step
    (what they save on a CPU, the split's own cost, is not in these unit costs)."""
    from ndtrain.parallel.pipeline.lists import deferred
    from ndtrain.parallel.pipeline.schedules import B, SEND_B, W, Action, parts
    lists = build_schedule("zbv", 2, 2, 8)
    assert deferred(lists[0]) == {(0, i) for i in range(8)} and deferred(lists[1]) == {(2, i) for i in range(8)}
    zb = build_schedule("zb", 4, 1, 8)
    assert [deferred(r) for r in zb] == [{(0, i) for i in range(8)}, set(), set(), set()]
    for name, pp in (("zbv", 2), ("zbv", 4), ("dualpipev", 4), ("zb", 4)):
        lists = build_schedule(name, pp, 2 if name != "zb" else 1, 8)
        for r, actions in enumerate(lists):  # every deferred key's gradient is read after its W, if at all
            flat = [p for a in actions for p in parts(a)]
            for c, i in deferred(actions):
                at_w = flat.index(Action(W, c, i))
                readers = [k for k, a in enumerate(flat) if (a.kind, a.chunk, a.micro) in
                           ((SEND_B, c, i), (B, c - 1, i))]
                assert all(k > at_w for k in readers), (name, pp, r, c, i)
        plain, defer = simulate(lists, 1, 1, 1)[0], simulate(lists, 1, 1, 1, defer=True)[0]
        assert defer <= plain + 1e-12, (name, pp)


def test_partition_counts_the_head_and_can_be_overridden():
    from ndtrain.model.args import PRESETS
    a = PRESETS["tiny"].with_(n_layers=8, vocab_size=2048)  # a head worth ~3.4 blocks
    embedding, blocks, head = layer_costs(a, 32)
    assert head > 3 * blocks[0] and embedding < blocks[0] / 100
    counts = chunk_counts(a, 2, 32)
    assert counts == [6, 2]  # the last stage carries the head, so fewer blocks
    assert chunk_counts(a.with_(vocab_size=64), 2, 32) == [4, 4]
    assert balanced_counts([1.0] * 8, 4, 0.0, 0.0) == [2, 2, 2, 2]
    assert chunk_counts(a, 4, 32, "1,2,3,2") == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="covers 7 layers"):
        chunk_counts(a, 4, 32, "1,2,2,2")


# --------------------------------------------------------------------------- torch.distributed.pipelining

TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}


def _grads_vs_torch_pipelining(data_dir):
    import torch.distributed.pipelining as pipelining

    from ndtrain.bench.pp import torch_v_schedules_run_on_gloo
    out = {(s, v): _one_schedule_vs_torch(data_dir, s, v)
           for s, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2))
           if hasattr(pipelining, TORCH_SCHEDULES[s])  # torch < 2.9 has no DualPipeV
           and (v == 1 or s == "interleaved" or torch_v_schedules_run_on_gloo())}
    return out, _overlap_hook(data_dir)


def _overlap_hook(data_dir):
    """DualPipeV with an overlap hook that runs each F&B's backward before its forward (they
    touch different chunks): called once per F&B, and the same gradients bit for bit."""
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.worker import mesh_shape

    cfg = validate(load_config(None, TINY + ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2",
                                             "train.micro_batch=1"]), world=dist.get_world_size())
    data = PreparedData.open(data_dir)
    x, y = BatchLoader(data.stream("train"), 32, 8, 0).rows(0, 0, 8)
    micro = MicroBatch(x, y).split(1)
    par = build(cfg.model_args(vocab_size=data.vocab_size), ParallelMesh.build(mesh_shape(cfg)), cfg)
    par.forward_backward(micro, 256.0)
    default = {k: p.grad.clone() for k, p in par.model.named_parameters()}
    par.grad_sync.zero_grad()
    calls = []

    def backward_first(forward, backward):
        calls.append(1)
        backward()
        forward()
    par.schedule.overlap = backward_first
    par.forward_backward(micro, 256.0)
    pairs = sum(g[0].kind == "FB" for g in par.schedule.plan(8, train=True).groups)
    same = all(torch.equal(p.grad, default[k]) for k, p in par.model.named_parameters())
    return len(calls), pairs, same


def _one_schedule_vs_torch(data_dir, schedule, virtual):
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build, decoder, materialized
    from ndtrain.parallel.pipeline.stage import build_chunks
    from ndtrain.model.loss import token_loss_sum
    from ndtrain.train.worker import mesh_shape

    m = 4
    cfg = validate(load_config(None, TINY + ["parallel.pp=2", f"parallel.pp_schedule={schedule}",
                                             f"parallel.pp_virtual={virtual}", "train.micro_batch=2"]),
                   world=dist.get_world_size())
    data = PreparedData.open(data_dir)
    args = cfg.model_args(vocab_size=data.vocab_size)
    mesh = ParallelMesh.build(mesh_shape(cfg))
    x, y = BatchLoader(data.stream("train"), 32, 8, 0).rows(0, 0, 8)
    n = float((y != -100).sum())

    ours = build(args, mesh, cfg)
    ours.forward_backward(MicroBatch(x, y).split(2), n)
    mine = {k: p.grad.clone() for k, p in ours.model.named_parameters()}

    chunks = build_chunks(args, mesh, cfg, decoder(args, mesh, cfg))  # fresh copies, same initial weights
    chunks = {c: materialized(chunk, args, mesh, cfg) for c, chunk in chunks.items()}
    stages = [PipelineStage(chunk, c, 2 * virtual, torch.device("cpu")) for c, chunk in chunks.items()]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(cls).parameters else {}
    loss_fn = lambda out, target: token_loss_sum(out, target) / n  # noqa: E731
    ref = cls(stages[0] if schedule == "1f1b" else stages, m, loss_fn=loss_fn, **kwargs)
    v_shape = schedule in ("zbv", "dualpipev")  # both ends on rank 0
    first, last = mesh.is_first_stage, mesh.is_first_stage if v_shape else mesh.is_last_stage
    ref.step(*((x,) if first else ()), **({"target": y} if last else {}))
    theirs = {k: p.grad for chunk in chunks.values() for k, p in chunk.named_parameters()}
    assert mine.keys() == theirs.keys()
    return max(((mine[k] - theirs[k]).norm() / theirs[k].norm()).item() for k in mine)


def test_gradients_match_torch_pipelining(tiny_data):
    """Same split, same weights, same micro-batches: Schedule1F1B (pp 2),
    ScheduleInterleaved1F1B (pp 2 × v 2), ScheduleZBVZeroBubble and ScheduleDualPipeV (pp 2,
    two chunks per rank in a V) give the gradients we give. And DualPipeV's overlap hook."""
    for compared, (calls, pairs, same) in run_ranks(_grads_vs_torch_pipelining, 2, tiny_data):
        from ndtrain.bench.pp import torch_v_schedules_run_on_gloo
        v_shaped = {"zbv"} if torch_v_schedules_run_on_gloo() else set()
        assert {s for s, _ in compared} >= {"1f1b", "interleaved"} | v_shaped
        for (schedule, virtual), worst in compared.items():
            assert worst < 1e-6, (schedule, virtual, worst)
        assert calls == pairs > 0 and same, (calls, pairs, same)


# --------------------------------------------------------------------------- more layouts, memory, messages

EIGHT_LAYERS = ["model.n_layers=8"]
SPECIAL = [  # (name, pipeline overrides on 4 ranks, the single-process reference's overrides)
    ("pp4-interleaved-v2-m4", ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
                               "train.micro_batch=2", *EIGHT_LAYERS], ["train.micro_batch=2", *EIGHT_LAYERS]),
    ("pp4-interleaved-v2-m8", ["parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
                               "train.micro_batch=1", *EIGHT_LAYERS], ["train.micro_batch=1", *EIGHT_LAYERS]),
    ("pp2-zero1-zb-tied", ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.pp_schedule=zb",
                           "train.micro_batch=1", "model.tie_embeddings=true"], ["model.tie_embeddings=true"]),
    ("pp2-tp2-tied", ["parallel.pp=2", "parallel.tp=2", "train.micro_batch=2", "model.tie_embeddings=true"],
     ["model.tie_embeddings=true"]),  # vocabulary-split embedding and head, summed across the ends
]
EVAL = ["train.eval_batches=2"]  # the last step evaluates: forward-only through the pipeline


def _references(data_dir):
    out = {}
    for name, _, ref in SPECIAL:
        losses, state, trainer = train_in_rank(ref + EVAL, data_dir)
        out[name] = (losses, state, trainer.history[-1]["val_loss"])
    return out


def _special_layouts_and_counts(data_dir):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.data.batch import MicroBatch
    from ndtrain.data.loader import BatchLoader
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.parallel.parallelize import build
    from ndtrain.train.step import TrainStep
    from ndtrain.train.worker import mesh_shape

    runs = {}
    for name, overrides, _ in SPECIAL:
        losses, state, trainer = train_in_rank(overrides + EVAL, data_dir)
        runs[name] = (losses, state, trainer.history[-1]["val_loss"])

    # Activations held (counted, and in bytes by the memory accounting) and messages sent,
    # over one step of 8 micro-batches on 4 stages (and 1F1B on one micro-batch, for scale)
    data = PreparedData.open(data_dir)
    x, y = BatchLoader(data.stream("train"), 32, 8, 0).rows(0, 0, 8)
    micro = MicroBatch(x, y).split(1)
    peaks, traffic, activation_bytes = {}, {}, {}
    for schedule, extra, m in (("afab", [], 8), ("1f1b", [], 8), ("zb", [], 8), ("1f1b", [], 1),
                               ("interleaved", ["parallel.pp_virtual=2", *EIGHT_LAYERS], 8)):
        cfg = validate(load_config(None, TINY + ["parallel.pp=4", f"parallel.pp_schedule={schedule}",
                                                 "train.micro_batch=1", *extra]), world=dist.get_world_size())
        mesh = ParallelMesh.build(mesh_shape(cfg))
        par = build(cfg.model_args(vocab_size=data.vocab_size), mesh, cfg)
        par.forward_backward(micro[:m], 256.0)  # the first step also agrees on the shapes
        par.grad_sync.zero_grad()
        mesh.stats.reset()
        step = TrainStep(par, cfg)
        step.forward_backward(micro[:m], 256.0, measure_memory=True)
        key = schedule if m == 8 else f"{schedule}-m{m}"
        peaks[key], activation_bytes[key] = par.schedule.peak_held, step.memory.activations
        traffic[key] = (mesh.stats.tallies[("pp", "send")].calls, mesh.stats.tallies[("pp", "recv")].calls)

    # Gradient sync over dp: once per step, each bucket once, after the last backward of
    # each of the rank's two chunks, though 4 micro-batches ran on each.
    cfg = validate(load_config(None, TINY + ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=interleaved",
                                             "parallel.pp_virtual=2", "train.micro_batch=1",
                                             "parallel.bucket_mb=0.01"]), world=dist.get_world_size())
    mesh = ParallelMesh.build(mesh_shape(cfg))
    par = build(cfg.model_args(vocab_size=data.vocab_size), mesh, cfg)
    rows = 4 * mesh.dp_rank
    mine = MicroBatch(x[rows:rows + 4], y[rows:rows + 4]).split(1)
    par.forward_backward(mine, 256.0)
    mesh.stats.reset()
    par.forward_backward(mine, 256.0)
    tally = mesh.stats.tallies[("dp_cp", "all_reduce")]
    grad_sync = (tally.calls, len(par.grad_sync.buckets), tally.payload, sum(p.numel() * 4 for p in par.model.parameters()))
    return runs, peaks, traffic, grad_sync, activation_bytes


@pytest.mark.slow
def test_interleaved_pp4_and_tied_embeddings_match_one_process(tiny_data):
    refs = run_ranks(_references, 1, tiny_data)[0]
    results = run_ranks(_special_layouts_and_counts, 4, tiny_data, timeout=600)
    for name, _, _ in SPECIAL:
        losses, state, val = results[0][0][name]
        ref_losses, ref_state, ref_val = refs[name]
        try:
            assert_losses_close(losses, ref_losses, 1e-5)
            assert_states_close(state, ref_state, 1e-5)
            assert abs(val - ref_val) <= 1e-5 * ref_val, f"val_loss {val} vs {ref_val}"
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None
        for rank in results[1:]:
            assert rank[0][name][0] == losses and rank[0][name][2] == val
    # Peak activation memory, counted in micro-batches held on each stage (stage 0 first):
    # 1F1B at most pp, AFAB all m, zero bubble the peak of 1F1B.
    peaks = [rank[1] for rank in results]
    assert [p["afab"] for p in peaks] == [8, 8, 8, 8] and peaks[0]["1f1b-m1"] == 1
    assert [p["1f1b"] for p in peaks] == [4, 3, 2, 1]
    assert max(p["zb"] for p in peaks) == 4
    assert peaks[0]["interleaved"] > 4  # interleaving buys its bubble with memory
    # The same in bytes (observe/memory.py) on stage 0: AFAB holds about twice what 1F1B
    # holds, and each micro-batch held costs the same in both (within 30%).
    mem = results[0][4]
    assert mem["afab"] > 1.6 * mem["1f1b"], mem
    per_afab = (mem["afab"] - mem["1f1b-m1"]) / (8 - 1)
    per_1f1b = (mem["1f1b"] - mem["1f1b-m1"]) / (4 - 1)
    assert abs(per_afab - per_1f1b) < 0.3 * per_1f1b, mem
    # Messages: one activation forward and one gradient back per micro-batch and chunk
    # boundary, nothing more (the shapes were agreed on the first step).
    for rank, result in enumerate(results):
        for schedule, (sends, recvs) in result[2].items():
            if schedule == "1f1b-m1":
                continue
            v = 2 if schedule == "interleaved" else 1
            chunks = [rank + 4 * k for k in range(v)]
            links = sum((c > 0) + (c < 4 * v - 1) for c in chunks)
            assert sends == recvs == 8 * links, (schedule, rank, sends, recvs)
        calls, buckets, payload, param_bytes = result[3]
        assert calls == buckets > 1 and payload == param_bytes, result[3]


# --------------------------------------------------------------------------- checkpoints

RESUME = ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "train.micro_batch=2",
          "model.tie_embeddings=true", "train.steps=6", "train.eval_every=3"]


def test_pipeline_checkpoint_resumes_bit_exact_and_holds_the_full_model(tiny_data, tmp_path):
    """Each stage writes its chunks' global tensors; a plain Transformer reads the whole
    model back from them; 3 + 3 steps equal 6 bit for bit."""
    from ndtrain.checkpoint import store
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import CheckpointSource
    from ndtrain.model.args import ModelArgs
    from ndtrain.model.llama import Transformer
    from ndtrain.observe.metrics import read_metrics

    from test_resume import _straight_vs_resumed
    straight, resumed, s_state, r_state, step = run_ranks(_straight_vs_resumed, 2, tiny_data, str(tmp_path),
                                                          RESUME, 3)[0]
    assert step == 6 and straight == resumed
    for k in s_state:
        assert torch.equal(s_state[k], r_state[k]), k
    a = [r.get("val_loss") for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")]
    b = [r.get("val_loss") for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")]
    assert a == b and a[2] is not None
    last = store.latest(tmp_path / "resumed")
    assert sorted(p.name for p in last.iterdir()) == ["meta.json", "rank-00000.safetensors", "rank-00001.safetensors"]
    meta = store.read_meta(last)
    assert "weight/output.weight" not in meta["tensors"]  # tied: the embedding is the one copy
    model = Transformer(ModelArgs(**meta["model_args"]))
    load_model(CheckpointSource(last, meta), model)
    loaded = model.state_dict()
    assert set(r_state) <= set(loaded)
    for k, v in r_state.items():
        assert torch.equal(loaded[k], v), k


# --------------------------------------------------------------------------- the trace

def _trace(data_dir, out):
    import torch.distributed as dist

    from ndtrain.config import load_config, validate
    from ndtrain.data.prepare import PreparedData
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.trace import trace_run
    from ndtrain.train.worker import mesh_shape
    cfg = validate(load_config(None, TINY + ["parallel.pp=2", "parallel.pp_schedule=zb", "train.micro_batch=1",
                                             "train.steps=2"]), world=dist.get_world_size())
    return trace_run(cfg, ParallelMesh.build(mesh_shape(cfg)), PreparedData.open(data_dir), out)


def test_trace_writes_chrome_json_picture_and_bubble(tiny_data, tmp_path):
    import json
    report = run_ranks(_trace, 2, tiny_data, tmp_path)[0]
    assert report["schedule"] == "zb" and report["micro_batches"] == 8
    assert report["measured_bubble"] > 0 and report["theory_bubble"] > 0 and set(report["mean_ms"]) == {"F", "B", "W"}
    assert 0 < report["replayed_bubble"] <= report["measured_bubble"] + 0.05
    assert report["simulated_step_ms"] > 0 and report["measured_step_ms"] > 0 and report["simulated_bubble"] >= 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for rank in (0, 1):
        compute = [e for e in events if e.get("tid") == rank and e.get("cat") in ("F", "B", "W")]
        assert sorted(e["cat"] for e in compute) == ["B"] * 8 + ["F"] * 8 + ["W"] * 8
        assert all(e["dur"] >= 0 for e in compute)
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("overrides, fragment", [
    (["parallel.pp=4", "parallel.pp_virtual=2", "parallel.pp_schedule=interleaved", "run.nproc=4"],
     "model.n_layers = 4: must be at least pp × pp_virtual = 4 × 2 = 8"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved", "train.global_batch=6", "train.micro_batch=2",
      "run.nproc=2"], "global_batch / (dp × micro_batch) = 6 / (1 × 2) = 3 to be a multiple of parallel.pp = 2"),
    (["parallel.pp=2", "parallel.pp_schedule=gpipe"], "parallel.pp_schedule = 'gpipe': unknown schedule"),
    (["parallel.pp=2", "parallel.pp_split=1,2"], "parallel.pp_split = '1,2': covers 3 layers, but model.n_layers = 4"),
    (["parallel.pp=2", "parallel.pp_split=1,1,2"], "lists 3 chunks, but pp × pp_virtual = 2"),
    (["parallel.pp=2", "parallel.pp_split=0,4"], "every chunk needs at least one layer"),
    (["parallel.pp=2", "parallel.pp_split=2;2"], "expected layers per chunk"),
    (["parallel.pp_virtual=2"], "parallel.pp_virtual = 2: needs parallel.pp > 1"),
    (["parallel.pp=2", "parallel.pp_virtual=2"], "needs parallel.pp_schedule = 'interleaved'"),
    (["parallel.pp=2", "parallel.pp_schedule=zbv"],
     "parallel.pp_virtual = 1: parallel.pp_schedule = 'zbv' runs two chunks per rank (a V): set parallel.pp_virtual = 2"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=3", "model.n_layers=6"],
     "set parallel.pp_virtual = 2"),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual=2", "train.global_batch=6",
      "train.micro_batch=2", "run.nproc=2"], "parallel.pp_schedule = 'dualpipev': needs at least 2 × parallel.pp = 4 "
                                             "micro-batches; global_batch / (dp × micro_batch) = 6 / (1 × 2) = 3"),
])
def test_pipeline_config_errors(overrides, fragment):
    from ndtrain.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["model.preset=tiny", "run.device=cpu"] + overrides))
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv", [
    ["train", "--nproc", "2", "parallel.pp=2", "parallel.pp_split=1,2"],
    ["trace", "--nproc", "2"],  # a trace needs a pipeline
])
def test_cli_refuses_bad_pipelines_before_writing(argv, tmp_path, capsys, monkeypatch):
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(argv + ["model.preset=tiny", f"run.dir={tmp_path / 'run'}", "run.device=cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "parallel.pp" in err
    assert list(tmp_path.iterdir()) == []
