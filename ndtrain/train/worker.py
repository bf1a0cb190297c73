"""What each training process runs: join the group, build the mesh, train."""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path

import torch.distributed as dist

from ndtrain import config as config_mod
from ndtrain import supervisor
from ndtrain.checkpoint import hf_files
from ndtrain.data.prepare import PreparedData, prepare_data
from ndtrain.launch import init_process, set_collective_timeout, shutdown
from ndtrain.mesh import MeshShape, ParallelMesh


def mesh_shape(cfg: config_mod.Config) -> MeshShape:
    p = cfg.parallel
    return MeshShape(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)


def prepare_on_each_node(cfg: config_mod.Config, local_rank: int) -> Path:
    """Under torchrun every node prepares its own copy once (local rank 0), the others wait."""
    d = cfg.data
    kwargs = dict(source=d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                  val_fraction=d.val_fraction, cache_dir=d.cache_dir, jsonl_key=d.jsonl_key)
    path = None
    if local_rank == 0:  # a failure here ends the job: torchrun stops the waiting ranks
        path = prepare_data(**kwargs, progress=True)
        PreparedData.open(path).verify()
    if dist.is_initialized():
        dist.barrier()
    return path or prepare_data(**kwargs, progress=False)


def resolve_vocab(cfg: config_mod.Config, data: PreparedData) -> None:
    """model.vocab_size from the tokenizer, or check that the one given covers it; and that
    the corpus holds a sequence of train.seq_len."""
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.vocab_size
    elif cfg.model.vocab_size < data.vocab_size:
        raise config_mod.ConfigError("model.vocab_size", cfg.model.vocab_size,
                                     f"must be at least the tokenizer's vocabulary, {data.vocab_size}")
    check_corpus_length(cfg, data)


def check_corpus_length(cfg: config_mod.Config, data: PreparedData) -> None:
    """Both splits hold at least one sequence of train.seq_len + 1 tokens (ConfigError,
    before any process starts or the run directory is written)."""
    need = cfg.train.seq_len + 1
    for split in ("train", "val"):
        have = int(data.meta[f"{split}_tokens"])
        if have < need:
            raise config_mod.ConfigError("train.seq_len", cfg.train.seq_len, f"is longer than the corpus' {split} split "
                                         f"({have:,} tokens of {data.path.name}): one sequence needs seq_len + 1 = "
                                         f"{need:,}; use a shorter train.seq_len or more data")


def write_run_files(cfg: config_mod.Config, data: PreparedData, run_dir: Path) -> None:
    """The resolved config and the tokenizer, so the run directory is self-contained. Called
    once the run has started (or resumed) successfully: a resume never changes the
    tokenizer (resume.py refuses other data), and the config then records the new layout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_mod.to_toml(cfg))
    if not (run_dir / "tokenizer.json").is_file():
        shutil.copyfile(data.path / "tokenizer.json", run_dir / "tokenizer.json")
    hf_files.carry(cfg.model.init_from, run_dir)


def from_rank_0(value: str) -> str:
    """Rank 0's `value` on every rank. Under torchrun each process chose its run directory
    itself, and a default one comes from that process's clock: rank 0's choice wins."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train_worker(cfg_dict: dict, run_dir: str, data_dir: str | None, before_fit=None) -> dict:
    """Entry point of one rank. Returns the run summary on rank 0 ({} elsewhere).
    `before_fit(trainer)` runs after the start (tests install faults with it)."""
    control = supervisor.control()
    # Watched by our launcher, a rank takes SIGTERM as "stop"; otherwise (torchrun, or one
    # process in the command's own) it arms SIGINT and SIGTERM itself.
    with nullcontext() if control.watched else supervisor.stop_signals():
        return _train(config_mod.from_dict(cfg_dict), run_dir, data_dir, before_fit, control)


def _train(cfg: config_mod.Config, run_dir: str, data_dir: str | None, before_fit, control) -> dict:
    from ndtrain.train.tasks import Pretrain
    from ndtrain.train.trainer import Trainer

    env = init_process(cfg.run.device, cfg.run.threads, cfg.run.collective_timeout_s)
    try:
        run_dir = from_rank_0(run_dir)
        data_path = Path(data_dir) if data_dir else prepare_on_each_node(cfg, env.local_rank)
        data = PreparedData.open(data_path)
        resolve_vocab(cfg, data)
        mesh = ParallelMesh.build(mesh_shape(cfg), env.device)
        trainer = Trainer(cfg, mesh, Pretrain(cfg, data), Path(run_dir), local_world=env.local_world,
                          control=control)
        set_collective_timeout(cfg.run.collective_timeout_s)  # every group exists now
        trainer.start()
        if env.rank == 0:
            write_run_files(cfg, data, Path(run_dir))
        if before_fit is not None:
            before_fit(trainer)
        return trainer.fit(stop_after=cfg.run.stop_after)
    finally:
        shutdown()
