"""The frontier features in compositions on 8 ranks, in one launch (issues 34, 35 and 38): the
default tier's row of the "compositions on 8 ranks" family for Muon, DeepSeek-V3 and NVFP4, held to the fp64 proofs' rule
(tests/helpers.py `prove`) against the same single-process references as the features' own
files (session fixtures in tests/conftest.py, computed once).

- Muon on HSDP (2 replicas of ZeRO-3 over 2 ranks) × tp2: the replicate and shard groups
  and the TP shards of each logical matrix together;
- DeepSeek-V3 with its MTP module on ZeRO-3 × tp2 × cp2 × ep2 (latent attention's heads over
  tp, its unequal widths over the ring, group-limited routing over ep, the MTP targets under
  the zigzag layout, flat slices over dp);
- NVFP4 with its whole recipe on HSDP × tp2 (the stochastic rounding's numbers keyed by the
  global micro-batch over replicas and shards, the amaxes over tp; issue 38).

The features' other 8-rank rows (Muon on pp2 × tp2 × dp2 and ZeRO-3 dp4 × tp2, DeepSeek's
dp2·tp2·pp2 and DualPipeV·cp2·ep2, gpt-oss's three) and Muon's 4-rank HSDP are in the slow
tier of their own files. One launch of 8 processes on 2 cores costs about as much
as the rows' compute; a launch per feature would pay its start and its ranks' first steps
three times.
"""

from helpers import proof_in_rank, prove
from ndtrain.testing import run_ranks
from test_deepseek_layouts import BATCH, DS, _check as check_deepseek
from test_muon import MUON
from test_mx_layouts import overrides as mx

NVFP4 = mx("nvfp4", ["train.global_batch=16"])  # 4 micro-batches of 4 rows: one per data-parallel rank
ROWS = [
    ("muon", "hsdp2-zero3-tp2", MUON + ["parallel.dp_replicate=2", "parallel.zero=3", "parallel.tp=2"]),
    ("nvfp4", "hsdp2-zero3-tp2", NVFP4 + ["parallel.dp_replicate=2", "parallel.zero=3", "parallel.tp=2"]),
    ("deepseek", "zero3-tp2-cp2-ep2", DS + BATCH + ["parallel.dp=2", "parallel.zero=3", "parallel.tp=2",
                                                    "parallel.cp=2", "parallel.ep=2"]),
]


def _nvfp4_reference(data_dir):
    from helpers import reference_in_rank
    return reference_in_rank(NVFP4, data_dir)


def _rows(data_dir, rows):
    return {(feature, name): proof_in_rank(overrides, data_dir) for feature, name, overrides in rows}


def test_frontier_features_in_8_rank_compositions_equal_one_process(tiny_data, muon_refs, deepseek_reference):
    nvfp4 = run_ranks(_nvfp4_reference, 1, tiny_data, timeout=900)[0]
    results = run_ranks(_rows, 8, tiny_data, ROWS, timeout=900)[0]
    for (feature, name), proof in results.items():
        if feature == "muon":
            prove(f"muon {name}", proof, muon_refs["dense"])
        elif feature == "nvfp4":
            prove(f"nvfp4 {name}", proof, nvfp4)
        else:
            check_deepseek({name: proof}, deepseek_reference)
