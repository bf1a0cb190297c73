"""What each training process runs: join the group, build the mesh, train."""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path

import torch.distributed as dist

from ndtrain import config as config_mod
from ndtrain import supervisor
from ndtrain.checkpoint import hf_files
from ndtrain.data.mix_prepare import SourceSpec, open_mixture, prepare_mixture
from ndtrain.data.mixture import PreparedMixture
from ndtrain.data.prepare import PreparedData
from ndtrain.data.sources import check_source
from ndtrain.data.token_files import prepare_source
from ndtrain.launch import configure_numerics, init_process, local_rank, set_collective_timeout, shutdown, warn
from ndtrain.mesh import MeshShape, ParallelMesh


def mesh_shape(cfg: config_mod.Config) -> MeshShape:
    p = cfg.parallel
    return MeshShape(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)


def source_specs(cfg: config_mod.Config) -> list[SourceSpec]:
    """data.sources as the data package takes them (text_key "" is data.text_key)."""
    return [SourceSpec(s["name"], s["path"], s["weight"], s["text_key"] or cfg.data.text_key, s["repeat"])
            for s in cfg.data.sources]


def prepare(cfg: config_mod.Config, progress: bool) -> PreparedData | PreparedMixture:
    """The prepared data of `cfg`, prepared now if the cache lacks it: data.path's directory,
    or a mixture of data.sources' directories sharing one tokenizer."""
    d = cfg.data
    if d.sources:
        return prepare_mixture(source_specs(cfg), d.tokenizer, d.vocab_size, d.val_fraction, d.cache_dir, progress,
                               d.workers, d.on_bad_record)
    if d.path != "stdlib" and not config_mod.is_prepared_folder(d.path):  # before anything is written
        check_source(Path(d.path).expanduser().resolve(), d.text_key)
    return PreparedData.open(prepare_source(d.path, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                                          val_fraction=d.val_fraction, cache_dir=d.cache_dir, text_key=d.text_key,
                                          progress=progress, workers=d.workers, on_bad_record=d.on_bad_record))


def prepared_paths(data: PreparedData | PreparedMixture) -> str | list[str]:
    """What the ranks get to open the data again (open_prepared): a directory, or one per source."""
    if isinstance(data, PreparedMixture):
        return [str(s.data.path) for s in data.sources]
    return str(data.path)


def open_prepared(cfg: config_mod.Config, paths: str | list[str]) -> PreparedData | PreparedMixture:
    if isinstance(paths, list):
        return open_mixture(source_specs(cfg), paths)
    return PreparedData.open(paths)


def prepare_before_the_group(cfg: config_mod.Config) -> PreparedData | PreparedMixture:
    """Under torchrun or srun, before the process group exists: every process asks for the
    data; the first of a node to take the cache's build lock (data/prepare.py) prepares it,
    the others wait on that lock and then open what it built. No collective waits meanwhile,
    so a cold cache on a large corpus takes as long as it takes (inside a NCCL barrier it
    would meet the collective timeout). Local rank 0 shows the progress and verifies."""
    first = local_rank() == 0
    data = prepare(cfg, progress=first)
    if first:
        data.verify()
    return data


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


def start_trainer(cfg: config_mod.Config, env, make_task, run: Path | None, control):
    """The mesh, the trainer of `make_task()` (built once the mesh exists) writing to `run`,
    every group's collective timeout, and the start: resume `run`'s checkpoint, or load
    model.init_from. What every task's rank does first."""
    from ndtrain.replicas.lighthouse import environment
    from ndtrain.replicas.run import inner_config
    from ndtrain.train.trainer import Trainer
    configure_numerics(env.device, cfg.train.tf32, cfg.run.deterministic)
    replicas = environment() if cfg.run.fault_tolerance == "replicas" else None  # replicas/launch.py set it
    layout = inner_config(cfg, replicas["replicas"]) if replicas else cfg  # one replica group's
    mesh = ParallelMesh.build(mesh_shape(layout), env.device)
    trainer = Trainer(cfg, mesh, make_task(), run, local_world=env.local_world, control=control, replicas=replicas)
    set_collective_timeout(cfg.run.collective_timeout_s)  # every group exists now
    trainer.start()
    return trainer


def write_posttrain_files(cfg: config_mod.Config, run: Path, template, skipped: list[str] = ()) -> None:
    """What a fine-tuning run (sft, dpo, rl) keeps beside its checkpoints, written by rank 0
    once started (a refused resume leaves the run's files as they were): the config, the
    chat template, the Hugging Face files of model.init_from, and the records skipped."""
    (run / "config.toml").write_text(config_mod.to_toml(cfg))
    template.save(run)
    hf_files.carry(cfg.model.init_from, run, template.stop_ids)
    if skipped:
        (run / "skipped_records.txt").write_text("".join(line + "\n" for line in skipped))


def from_rank_0(value: str) -> str:
    """Rank 0's `value` on every rank. Under torchrun each process chose its run directory
    itself, and a default one comes from that process's clock: rank 0's choice wins."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train_worker(cfg_dict: dict, run_dir: str, data_dir: str | list[str] | None, before_fit=None) -> dict:
    """Entry point of one rank. Returns the run summary on rank 0 ({} elsewhere).
    `before_fit(trainer)` runs after the start (tests install faults with it)."""
    control = supervisor.control()
    # Watched by our launcher, a rank takes SIGTERM as "stop"; otherwise (torchrun, or one
    # process in the command's own) it arms SIGINT and SIGTERM itself.
    with nullcontext() if control.watched else supervisor.stop_signals():
        return _train(config_mod.from_dict(cfg_dict), run_dir, data_dir, before_fit, control)


def _train(cfg: config_mod.Config, run_dir: str, data_dir: str | None, before_fit, control) -> dict:
    from ndtrain.train.tasks import Pretrain

    data = open_prepared(cfg, data_dir) if data_dir else prepare_before_the_group(cfg)
    env = init_process(cfg.run.device, cfg.run.threads, cfg.run.collective_timeout_s)
    try:
        run_dir = from_rank_0(run_dir)
        resolve_vocab(cfg, data)
        trainer = start_trainer(cfg, env, lambda: Pretrain(cfg, data), Path(run_dir), control)
        if not data_dir:  # torchrun: the command line did not say it (launch.warn: rank 0 only)
            warn(trainer.task.notes)
        if env.rank == 0:
            write_run_files(cfg, data, Path(run_dir))
        if before_fit is not None:
            before_fit(trainer)
        return trainer.fit(stop_after=cfg.run.stop_after)
    finally:
        shutdown()
