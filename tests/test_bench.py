"""The benchmarks' fairness rules and their plumbing (never their timings): every key reaches
both contenders or is refused, `model.preset` replaces the default shape, the anchors
recompute the regions ours does, and each benchmark's contenders run a step end to end."""

import re
from types import SimpleNamespace

import pytest

from ndtrain.cli import main
from ndtrain.testing import run_ranks


@pytest.mark.parametrize("argv, fragment", [
    (["dp", "train.steps=5"], "train.steps = 5: bench dp cannot apply it to both contenders"),
    (["dp", "parallel.zero=1"], "parallel.zero = 1: bench dp cannot apply it"),
    (["zero", "data.vocab_size=300"], "data.vocab_size = 300: bench zero cannot apply it"),
    (["tp", "parallel.bucket_mb=4"], "parallel.bucket_mb = 4.0: bench tp cannot apply it"),
    (["pp", "train.lr=0.1"], "train.lr = 0.1: bench pp cannot apply it"),
    (["pp", "parallel.pp_schedule=zb"], "parallel.pp_schedule = 'zb': bench pp cannot apply it"),
    (["dp", "train.precision=fp16"], "train.precision = 'fp16': a benchmark compares fp32 or bf16"),
    (["dp", "train.precision=bf16", "train.reduce_fp32=false"], "bf16_compress_hook) needs CUDA"),
    (["zero", "parallel.zero=2"], "parallel.zero = 2: bench zero compares ZeRO-3 with FSDP2"),
    (["tp", "model.tie_embeddings=true"], "model.tie_embeddings = True: DTensor's plan cannot shard"),
    (["pp", "--nproc", "4"], "--nproc = 4: bench pp compares pipelines alone: use --nproc 2"),
    (["sft", "data.packing=none"], "data.packing = 'none': bench sft cannot apply it"),
    (["lora", "sft.generate=2"], "sft.generate = 2: bench lora cannot apply it"),
    (["lora", "lora.rank=0"], "lora.rank = 0: bench lora compares adapters of rank > 0"),
    (["fp8", "train.precision=bf16"], "train.precision = 'bf16': bench fp8 cannot apply it"),
    (["muon", "train.optimizer=muon"], "train.optimizer = 'muon': bench muon cannot apply it"),
    (["muon", "parallel.zero=1"], "parallel.zero = 1: bench muon cannot apply it"),
    (["muon", "parallel.tp=2"], "parallel.tp = 2: bench muon cannot apply it"),
])
def test_a_key_that_would_reach_one_side_only_is_refused(argv, fragment, capsys):
    assert main(["bench"] + argv + ["run.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def _args(*overrides, nproc=2):
    return SimpleNamespace(config=None, overrides=list(overrides), nproc=nproc)


def test_model_preset_replaces_the_default_shape_and_user_keys_win():
    from ndtrain.bench import dp, tp
    from ndtrain.bench.common import bench_config
    from ndtrain.model.args import PRESETS
    default = bench_config(_args("run.device=cpu"), dp.BENCH)
    assert (default.model.dim, default.model.n_layers, default.parallel.bucket_mb) == (256, 8, 2.0)
    preset = bench_config(_args("run.device=cpu", "model.preset=125M"), dp.BENCH).model_args()
    assert preset == PRESETS["125M"].with_(max_seq_len=preset.max_seq_len)
    cfg = bench_config(_args("run.device=cpu", "model.preset=125M", "train.global_batch=4"), tp.BENCH)
    assert cfg.train.global_batch == 4 and cfg.model.tie_embeddings is False  # a setting, kept with a preset


def test_the_anchor_recomputes_the_regions_ours_does():
    import functools

    from torch.utils.checkpoint import checkpoint

    from ndtrain.bench.common import anchor_recompute
    from ndtrain.model.args import PRESETS
    from ndtrain.model.llama import Transformer
    from ndtrain.parallel.recompute import apply_recompute
    for spec in ("full", "every:3", "selective"):
        ours, theirs = Transformer(PRESETS["tiny"]), Transformer(PRESETS["tiny"])
        names = apply_recompute(ours, spec)
        anchor_recompute(theirs, spec)
        wrapped = [n for n, m in theirs.named_modules()
                   if isinstance(m.__dict__.get("forward"), functools.partial) and m.forward.func is checkpoint]
        assert wrapped == names


def _training_benches(cfg_dicts: dict) -> dict:
    """Each training benchmark's worker, one after the other (each ends the process group;
    the harness's store lets the next one start a new one)."""
    import datetime

    import torch.distributed as dist

    from ndtrain.bench import dp, tp, zero
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    out = {}
    for name, module in (("dp", dp), ("zero", zero), ("tp", tp)):
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=120))
        out[name] = module._worker(cfg_dicts[name], 1, 1)
    return out


@pytest.mark.slow
def test_training_benchmarks_run_end_to_end():
    """bf16, recomputation and two micro-batches: the anchors' autocast or mixed-precision
    policy, checkpointing and gradient accumulation all run."""
    from ndtrain.bench import dp, tp, zero
    from ndtrain.bench.common import bench_config
    overrides = ["model.preset=tiny", "train.seq_len=32", "train.global_batch=8", "run.device=cpu",
                 "run.threads=1", "train.precision=bf16", "train.recompute=selective", "train.micro_batch=2"]
    cfgs = {"dp": bench_config(_args(*overrides), dp.BENCH).to_dict(),
            "zero": bench_config(_args(*overrides), zero.BENCH).to_dict(),
            "tp": bench_config(_args(*overrides, "parallel.tp=2"), tp.BENCH).to_dict()}
    out = run_ranks(_training_benches, 2, cfgs, timeout=300)[0]
    for name, anchor in (("dp", "torch-ddp"), ("zero", "torch-fsdp2"), ("tp", "torch-dtensor-tp")):
        assert re.search(rf"\nndtrain/{anchor} throughput ratio: \d+\.\d\d$", out[name]), out[name]


def _pipeline_contests(cfg_dict: dict) -> list[str]:
    import torch

    from ndtrain.bench import pp
    from ndtrain.config import from_dict
    from ndtrain.data.batch import MicroBatch
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.worker import mesh_shape
    cfg = from_dict(cfg_dict)
    mesh = ParallelMesh.build(mesh_shape(cfg))
    args, t = cfg.model_args(), cfg.train
    x = torch.randint(0, args.vocab_size, (t.global_batch, t.seq_len))
    micro = MicroBatch(x, x).split(t.micro_batch)
    ran = []
    for name, anchor, virtual in pp._contests():
        c = pp._with_schedule(cfg, name, virtual)
        for step in (pp._ours(c, args, mesh, micro, 1.0), pp._anchor(c, args, mesh, anchor, x, x, 1.0, len(micro))):
            step()
        ran.append(anchor)
    return ran


@pytest.mark.slow  # bench plumbing; the executor's proofs stay
def test_pipeline_contests_run_each_pair():
    import torch

    from ndtrain.bench import pp
    from ndtrain.bench.common import bench_config
    cfg = bench_config(_args("model.preset=tiny", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=1",
                             "run.device=cpu", "train.recompute=full"), pp.BENCH)
    ran = run_ranks(_pipeline_contests, 2, cfg.to_dict(), timeout=300)
    assert ran[0] == [anchor for _, anchor, _ in pp.CONTESTS if anchor not in pp._skipped("cpu")]
    assert pp._skipped("cpu") == {} or torch.__version__ < "2.13", pp._skipped("cpu")  # 2.13: every pair


def test_bench_generate_takes_fewer_rounds_by_default(monkeypatch):
    """bench generate defaults to 5 rounds of 1 generation (one 256-token generation without
    a cache is ~20 s on a CPU); the others to 10 rounds of 3 steps; flags still win."""
    from ndtrain.bench import dp, generate
    from ndtrain.cli import main
    seen = {}
    for name, module in (("generate", generate), ("dp", dp)):
        monkeypatch.setattr(module, "run", lambda args, name=name: seen.__setitem__(name, (args.rounds, args.steps)) or 0)
    assert main(["bench", "generate"]) == 0 and main(["bench", "dp"]) == 0
    assert seen == {"generate": (5, 1), "dp": (10, 3)}
    assert main(["bench", "generate", "--rounds", "2", "--steps", "4"]) == 0 and seen["generate"] == (2, 4)


def test_bench_fp8_runs_bf16_and_every_recipe():
    """One round of bf16 and the five recipes (MXFP8 and NVFP4 included), one process: a ratio
    per recipe, tensorwise last."""
    from ndtrain.bench import fp8
    from ndtrain.bench.common import bench_config
    cfg = bench_config(_args("model.preset=tiny", "train.seq_len=32", "train.global_batch=4", "run.device=cpu",
                             "run.threads=1", nproc=1), fp8.BENCH)
    cfg.train.precision = "bf16"
    out = fp8._worker(cfg.to_dict(), 1, 1)
    for recipe in ("fp8 rowwise", "fp8 blockwise", "fp8 mxfp8", "nvfp4"):
        assert re.search(rf"\n{recipe}/bf16 throughput ratio: \d+\.\d\d\n", out), out
    assert re.search(r"\nfp8 tensorwise/bf16 throughput ratio: \d+\.\d\d$", out), out


def test_rounds_alternate_the_order_of_the_contenders():
    """A B, then B A: no contender always runs right after the same other one (in bench pp
    that had our side of every pair run after torch's previous schedule, round after round)."""
    import torch

    from ndtrain.bench.common import alternate
    calls = []
    times = alternate({name: (lambda n=name: calls.append(n)) for name in "ABC"}, rounds=3, steps=2,
                      device=torch.device("cpu"), warmup_rounds=1)
    assert "".join(calls) == "AABBCC" + "CCBBAA" + "AABBCC" + "CCBBAA"
    assert list(times) == ["A", "B", "C"] and all(len(t) == 3 for t in times.values())


@pytest.mark.slow  # six launches (a warm-up round and one round), four with a kill
def test_bench_ft_runs_both_sides_and_prints_the_ratio(capsys, tmp_path, tiny_data):
    """One round of restart against replicas on the tiny model: the restart redoes the steps
    since its checkpoint, the survivor of replicas loses none, the run without a kill gives
    the floor, and the last line is the ratio."""
    assert main(["bench", "ft", "--rounds", "1", "model.preset=tiny", "train.seq_len=32", "train.global_batch=8",
                 "train.steps=36", "run.device=cpu", "run.threads=1", f"data.path={tiny_data}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"round 1  restart: [\d.]+ s, 10 steps lost", out), out
    assert re.search(r"\nwarm-up round \(not counted\): restart [\d.]+ s, replicas [\d.]+ s, no kill [\d.]+ s\n"
                     r"round 1  restart", out), out
    assert re.search(r"round 1 replicas: [\d.]+ s, 0 steps lost", out), out
    assert re.search(r"round 1  no kill: [\d.]+ s, 0 steps lost", out), out
    assert re.search(r"\nfloor \d+\.\d\d \(no kill / restart\); over a run without a kill: replicas [+-]\d+\.\d s, "
                     r"restart [+-]\d+\.\d s\n", out), out
    assert re.search(r"\nndtrain ft replicas/restart wall-time ratio: \d+\.\d\d\n$", out), out
