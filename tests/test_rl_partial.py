"""Partial rollouts (rl.partial_rollout = continue; train/rl/rollout.generate_in_segments):
a generation that a weight update interrupts continues on the new weights, each token
tagged with the version that sampled it and keeping that version's log-probability (its
behaviour policy), against sequences built directly from the two models (fp64).

The whole run (generator process, trainer, importance weights per token) against a
one-process reference that samples each segment with its version's copy of the weights is
in tests/test_rl_async.py (slow tier)."""

from __future__ import annotations

import pytest
import torch

from ndtrain.generate.sampler import generate
from ndtrain.model.args import PRESETS
from ndtrain.model.llama import Transformer
from ndtrain.train.rl.rollout import Sampling, completion_logprobs, generate_in_segments, segment_seed

pytestmark = pytest.mark.usefixtures("one_thread")

STOPS = [3, 17]


def _model(seed: int) -> Transformer:
    model = Transformer(PRESETS["tiny"].with_(vocab_size=40, max_seq_len=64))
    model.init_weights(seed)
    return model.to(torch.float64).requires_grad_(False)


def _logp(model: Transformer, prompt: list[int], completion: list[int]) -> list[float]:
    """log p of each completion token after its prompt: a plain forward of the whole row."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion]))[0], -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]


def test_a_continued_generation_is_its_segments_each_on_its_own_weights_in_fp64():
    """Segments of 3 tokens, up to 8: segment 0 by version 5 (model A), the rest by version
    6 (model B). Every row equals the sequence built directly: A's first 3 tokens of the
    prompt with the row's seed, then B continuing prompt + those tokens with the row's
    segment streams; each token's version is its segment's, its recorded log-probability is
    its own version's (a plain forward, to 1e-12) and not the other's; the reference's
    log-probabilities are the whole completion's; a version held whole is `finish`."""
    a, b, ref = _model(3), _model(4), _model(5)
    prompts = [[1, 2, 4], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    seeds = [7, 8, 9, 10]
    sampling = Sampling(8, 1.0)
    asked = []

    def weights(j):
        asked.append(j)
        return (a, 5) if j == 0 else (b, 6)
    gen = generate_in_segments(weights, 3, prompts, seeds, sampling, STOPS, 0,
                               lambda i, ids: (float(len(ids)), 0.0, 0.0, 0.0), ref)
    assert asked == list(range(len(asked))) and len(asked) >= 2
    mixed = 0
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        want = generate(a, [p], 3, seeds=[s], stop_ids=STOPS).tokens[0]
        j = 1
        while len(want) < 8 and want[-1] not in STOPS:
            want += generate(b, [p + want], min(3, 8 - len(want)), seeds=[segment_seed(s, j)], stop_ids=STOPS).tokens[0]
            j += 1
        n = int(gen.lengths[i])
        assert gen.tokens[i, :n].tolist() == want and gen.scores[i, 0] == n
        versions = [5 if k < 3 else 6 for k in range(n)]
        assert gen.versions[i, :n].tolist() == versions
        own = [x if v == 5 else y for x, y, v in zip(_logp(a, p, want), _logp(b, p, want), versions)]
        other = [y if v == 5 else x for x, y, v in zip(_logp(a, p, want), _logp(b, p, want), versions)]
        assert max(abs(x - y) for x, y in zip(own, gen.logprobs[i, :n].tolist())) < 1e-12
        assert min(abs(x - y) for x, y in zip(other, gen.logprobs[i, :n].tolist())) > 1e-6
        assert max(abs(x - y) for x, y in zip(_logp(ref, p, want), gen.ref_logprobs[i, :n].tolist())) < 1e-12
        assert bool(gen.stopped[i]) == (want[-1] in STOPS)
        mixed += 6 in versions
    assert mixed >= 2  # rows that really crossed a weight update
    # One version for every segment: the segments' tokens are a function of the version only
    whole = generate_in_segments(lambda j: (a, 5), 3, prompts, seeds, sampling, STOPS, 0,
                                 lambda i, ids: (0.0,) * 4)
    assert (whole.versions[whole.tokens != 0] == 5).all()
    logp = completion_logprobs(a, prompts, [whole.tokens[i, :int(n)].tolist() for i, n in enumerate(whole.lengths)],
                               8, 0, 8)
    assert torch.allclose(logp, whole.logprobs, rtol=0, atol=1e-12)


def test_a_long_tail_cuts_all_but_a_share_of_prompts_and_keeps_their_tokens():
    """rl.long_tail: about that share of prompts (a hash of their tokens) may run to
    max_new_tokens, the others are cut at max_new_tokens // 8; a row cut at its limit holds
    the first tokens of the uncut generation (the same stream), and did not stop."""
    limits = Sampling(32, long_tail=0.1).limits([[i, i + 1] for i in range(2000)])
    assert set(limits) == {4, 32} and 0.08 < limits.count(32) / 2000 < 0.12
    assert Sampling(32).limits([[1]]) is None
    model, prompts, seeds = _model(3), [[1, 2, 4], [5, 6], [7, 8, 9]], [1, 2, 3]
    whole = generate(model, prompts, 8, seeds=seeds)
    cut = generate(model, prompts, 8, seeds=seeds, limits=[2, 8, 5])
    assert [len(t) for t in cut.tokens] == [2, 8, 5] and cut.stopped == [False] * 3
    assert all(c == w[:len(c)] for c, w in zip(cut.tokens, whole.tokens))


def test_bench_rl_idle_fractions_from_recorded_times_by_hand():
    """bench rl's idle fractions from the ranks' timelines (updates after the first, each
    spanning to the next one's start): synchronous, the rollout phase and the time not
    sampling; asynchronous, the wait for the rollout and the generator's own idle share."""
    from ndtrain.bench.rl import _measure
    hist = [{"step_time_s": 9.0}, {"step_time_s": 2.0}, {"step_time_s": 4.0}]
    sync = [{"history": hist, "timeline": [{"begin": 0, "end": 1, "sampled": 0.5}, {"begin": 2, "end": 3, "sampled": 2.5},
                                           {"begin": 6, "end": 7, "sampled": 6.5}]},
            {"history": hist, "timeline": [{"begin": 0, "end": 1, "sampled": 1}, {"begin": 2, "end": 4, "sampled": 3},
                                           {"begin": 6, "end": 9, "sampled": 7}]}]
    # rank 0: span 4, not training 1, sampling 0.5; rank 1: span 4, not training 2, sampling 1
    assert _measure(sync) == (3.0, 3 / 8, 1 - 1.5 / 8)
    hist = [dict(h, generator_idle=g) for h, g in zip(hist, (0.9, 0.1, 0.3))]
    tl = [{"begin": 0, "pushed": 0.1, "received": 1}, {"begin": 2, "pushed": 2.5, "received": 3}, {"begin": 4}]
    assert _measure([{"history": hist, "timeline": tl}]) == (3.0, 0.5, 0.2)
