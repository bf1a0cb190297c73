"""The `ndtrain` argument parser: one small function per command adds its subparser, in the
order `ndtrain --help` lists them; `parse` reads a command line with it."""

from __future__ import annotations

import argparse
import sys

from ndtrain import __version__

EPILOG = """\
examples:
  ndtrain train                                  the embedded default: small Llama on the stdlib, DP over 2 processes
  ndtrain train --nproc 4 train.steps=100        4-way data parallel
  ndtrain train --config configs/default.toml model.preset=tiny
  ndtrain train --nproc 4 parallel.zero=3 train.precision=bf16 train.recompute=full
                                                 ZeRO-3 (fully sharded), bf16 compute, every block recomputed
  ndtrain train --nproc 4 parallel.pp=2 parallel.pp_schedule=zb train.micro_batch=2
                                                 2 pipeline stages (zero bubble) × 2 data-parallel
  ndtrain train --dry-run --nproc 4 parallel.zero=2 model.preset=125M
                                                 memory per rank of a step, then exit (writes nothing)
  ndtrain sft                                    fine-tune the default run's model on stdlib functions (signature → body)
  ndtrain sft --show-example                     one training example, the trained (answer) tokens highlighted
  ndtrain sft data.path=chat.jsonl model.init_from=hf:./my-llama
                                                 fine-tune a Hugging Face model on your chats with its chat template
  ndtrain rl                                     the embedded default: SFT warm-up on addition (cached), then GRPO
  ndtrain rl rl.loss=dapo rl.task=sort           DAPO on sorting lists (after an SFT warm-up on sorting)
  ndtrain rl --evaluate model.init_from=run:DIR  held-out pass@1 and pass@k of a run's model on rl.task
  ndtrain dpo                                    the embedded default: SFT warm-up (cached), then DPO on stdlib pairs
  ndtrain dpo data.path=pairs.jsonl model.init_from=run:DIR dpo.beta=0.1
                                                 DPO on your preference pairs from a fine-tuned run
  ndtrain generate --run runs/train-... --prompt "def main("
  ndtrain train --nproc 4 parallel.tp=2 run.dir=runs/x   resume runs/x on another layout (any layout reads any checkpoint)
  ndtrain train --nproc 2 model.init_from=hf:DIR data.path=my.jsonl   start from a Hugging Face Llama/Qwen model
  ndtrain train --config mix.toml                pretrain on [[data.sources]]: parquet folders, .jsonl.zst, text, token
                                                 files, each with a weight (docs/data.md)
  ndtrain convert --to-hf runs/x --out hf/x      export a run as a Hugging Face model folder
  ndtrain checkpoint inspect runs/x              steps, layout, tensors and bytes per rank of a run's checkpoints
  ndtrain train --nproc 4 run.max_restarts=3 train.save_every=20   restart every rank (from the last good
                                                 checkpoint) when one dies or hangs
  Ctrl-C or SIGTERM (timeout, systemd, scancel, Kubernetes): every rank saves a checkpoint within train.log_every
                                                 steps (an RL rollout is cut short at once), exit 130 or 143, and the
                                                 command that continues the run is printed (with run.dir= added)
  run.dir=DIR                                    a new or empty folder, or an ndtrain run, which is continued; any
                                                 other folder (your own files in it) is refused, nothing written
  ndtrain trace --nproc 2 parallel.pp=2 train.micro_batch=1    a pipeline schedule as a picture
  ndtrain trace --nproc 2 parallel.cp=2 train.seq_len=512      context-parallel ring steps and their overlap
  ndtrain bench dp                               our DP against torch DDP, side by side
  ndtrain bench zero                             our ZeRO-3 against torch FSDP2, side by side
  ndtrain bench tp                               our TP+SP against DTensor TP+SP on 2 ranks, side by side
  ndtrain bench pp                               our 1F1B, interleaved and zero bubble against torch.distributed.pipelining,
                                                 and each schedule's bubble (real compute, paced, theory)
  ndtrain bench zero model.preset=125M train.global_batch=8
                                                 the same on a preset's shape (every benchmark takes model.preset)
  ndtrain bench sft                              fine-tuning on packed against padded rows, answer tokens/s
  ndtrain bench lora                             a LoRA step (rank 16) against a full fine-tuning step, tokens/s and states
  ndtrain bench cp                               context parallelism: ring vs allgather vs ulysses vs one process
  ndtrain bench generate                         batched generation with a KV cache against recomputing the prefix
  ndtrain bench ep                               experts split over 2 ranks (ep=2) against replicated (ep=1)
  ndtrain bench fp8 --nproc 1                    bf16 against fp8 tensorwise, rowwise, blockwise, mxfp8, nvfp4 (CPU: the emulation)
  ndtrain bench muon                             AdamW against Muon (train.optimizer=muon) under dp2 and ZeRO-3
  ndtrain bench compile                          the default job's step compiled (train.compile=true) against eager
  ndtrain bench gpu [--dry-run]                  the first GPU run: CUDA calls probed, CUDA tests, 1B MFU eager and
                                                 compiled, 2+ GPUs: every layout vs one GPU → runs/bench-gpu-*/report.md
  ndtrain bench prepare                          ndtrain prepare (a process per core) vs a bare tokenizers encode_batch loop
  ndtrain bench checkpoint                       our checkpoint save/load against torch.distributed.checkpoint (125M, 2 ranks)
  ndtrain bench rl --nproc 3                     synchronous RL on 3 ranks vs 2 training ranks + 1 generator (staleness 1),
                                                 a long tail of lengths; idle fractions, the logits peak, the wall-time ratio
  ndtrain train --nproc 4 parallel.tp=2          tensor (+ sequence) parallel over 2 ranks, times DP 2
  ndtrain train --nproc 4 model.preset=tiny-moe parallel.ep=2 parallel.dp=4
                                                 mixture of experts, experts split over 2 of the 4 data-parallel ranks
  ndtrain bench comm                             every collective's bus bandwidth; our ring all-reduce vs the backend's
  ndtrain plan --cluster H100-SXM --gpus 64 model.preset=8B train.precision=bf16 parallel.tp=8 parallel.zero=1
                                                 memory per rank, step time, MFU of a layout too large for this machine
  ndtrain plan --cluster H100-SXM --gpus 64 --search model.preset=8B train.precision=bf16
                                                 the fastest layouts that fit
"""


def _with_nproc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, metavar="N", help="local processes to start (same as run.nproc=N)")


def _with_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file with [model], [parallel], [train], [data], [run] tables")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=50 parallel.dp=2")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model (with no arguments: the embedded default job)",
                       description="Pretrain a model. With no arguments: a small Llama-style model on the Python "
                                   "standard library's source, data parallel over 2 CPU processes (or every local GPU).")
    _with_nproc(p)
    p.add_argument("--dry-run", action="store_true",
                   help="build the layout, run two steps on random tokens, print each rank's memory "
                        "(parameters, gradients, optimizer state, activations, peak) and exit; writes nothing")
    _with_config(p)


def _add_sft(sub) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on chat or prompt/completion JSONL (no arguments: "
                                   "the embedded default job)",
                       description="Fine-tune a model on conversations: the loss counts answer tokens only. With no "
                                   "arguments: the default pretraining run's model (trained first if there is none) "
                                   "on functions of the Python standard library, asked for by signature and docstring.")
    _with_nproc(p)
    p.add_argument("--show-example", action="store_true",
                   help="print one training example as the model sees it, the trained tokens highlighted, and exit")
    _with_config(p)


def _add_rl(sub) -> None:
    p = sub.add_parser("rl", help="reinforcement learning with verifiable rewards (no arguments: the embedded "
                                  "default job)",
                       description="Train a policy on a verifiable task: before each update it samples rl.group_size "
                                   "completions per prompt, a program scores them, and a policy-gradient loss "
                                   "(rl.loss: reinforce, grpo, dr_grpo, dapo) reinforces them by their advantage. "
                                   "Starts from model.init_from; with no arguments, from a short SFT warm-up on "
                                   "multi-digit addition (run through `ndtrain sft` once, cached, stopped when its "
                                   "held-out pass@1 reaches rl.warmup_target), then GRPO on 2 CPU processes (or "
                                   "every local GPU). model.init_from=scratch: random weights. rl.data=FILE: your "
                                   "own prompts and answers (JSONL or parquet) instead of a built-in task.")
    _with_nproc(p)
    p.add_argument("--evaluate", action="store_true",
                   help="only evaluate model.init_from's policy on held-out prompts (pass@1, pass@k) and exit; "
                        "writes nothing")
    _with_config(p)


def _add_dpo(sub) -> None:
    p = sub.add_parser("dpo", help="direct preference optimisation on JSONL preference pairs (no arguments: the "
                                   "embedded default job)",
                       description="Train a policy to prefer each pair's chosen answer over its rejected one with the "
                                   "sigmoid DPO loss −log σ(β · margin) (dpo.beta), against a frozen reference (the "
                                   "starting model, whose answer log-probabilities are computed once before training "
                                   "and kept with the run). Records: prompt, chosen and rejected as strings, as "
                                   "messages, or chosen and rejected as two whole chats whose last assistant turn is "
                                   "the choice. Held-out pairs report val_pref_accuracy and reward margins. Any "
                                   "layout but context parallelism. With no arguments: pairs from the standard "
                                   "library (the prompt asks for \" or ' quotes, in turn; the body written as asked "
                                   "is chosen over the same body written the other way), after a short SFT warm-up "
                                   "on both answers of the training pairs (run through `ndtrain sft` once, cached), "
                                   "on 2 CPU processes (or every local GPU). dpo.shuffle=true: the control, with "
                                   "chosen and rejected swapped in exactly half of every training batch's pairs.")
    _with_nproc(p)
    _with_config(p)


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus into token shards (cached)",
                       description="Train or load the tokenizer (data.tokenizer: a tokenizer.json, or hf:DIR for a "
                                   "Hugging Face model folder's) and write memory-mapped token shards, streaming the "
                                   "corpus on data.workers processes (0: one per core); an interrupted prepare "
                                   "continues where it stopped; data.on_bad_record decides a malformed record. "
                                   "`ndtrain train` does this itself when needed. docs/prepare.md.")
    _with_config(p)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a trained run",
                       description="Continue --prompt with the run's newest good checkpoint. The prompt is read as a "
                                   "Hugging Face tokenizer reads it (special tokens written in it are those tokens; a "
                                   "BOS the tokenizer adds is added); generation stops at every eos id of the run's "
                                   "generation_config.json (else at the tokenizer's end of text).")
    p.add_argument("--run", required=True, metavar="DIR", help="a run directory written by `ndtrain train`, `sft`, "
                                                              "`rl` or `convert --from-hf`")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="run a few pipelined or context-parallel steps; write the last one as a Chrome "
                                     "trace and a picture",
                       description="Train a few steps of a pipelined layout (parallel.pp > 1), then write the last "
                                   "step's per-rank timeline as trace.json (chrome://tracing, ui.perfetto.dev) and "
                                   "timeline.png, and print the measured bubble next to the theory. With context "
                                   "parallelism (parallel.cp > 1): every ring step of every layer and every message "
                                   "of the last step as ring-trace.json and ring.png, and the share of message time "
                                   "hidden behind attention compute. Writes no checkpoint.")
    _with_nproc(p)
    p.add_argument("--out", metavar="DIR", help="where to write (default runs/trace-<date>-<time>): a new or empty "
                                                "folder, or an earlier run's or trace's")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out that is not an ndtrain run, "
                                                            "beside (and over) its files")
    p.add_argument("--steps", type=int, default=3, help="training steps; the last one is drawn (default 3)")
    _with_config(p)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict memory per rank, step time and days of a layout on a cluster; "
                                    "--search for the best layouts that fit",
                       description="Plan before you spend: memory per rank (parameters, gradients, optimizer "
                                   "states, activations, communication buffers), step time (compute, TP/SP/CP/EP, "
                                   "pipeline bubble of the schedule simulated, DP/ZeRO, optimizer), tokens/s, MFU "
                                   "and HFU, and days, for a layout on a cluster too large for this machine; "
                                   "mixtures of experts (expert parallelism) and fp8 (train.precision=fp8, "
                                   "train.fp8_recipe, train.fp8_all_gather: planned from formulas; MXFP8 and "
                                   "train.precision=nvfp4 on B200/GB200) included. "
                                   "Checks the layout with the rules train enforces. Formulas and sources: "
                                   "docs/plan.md.")
    p.add_argument("--cluster", required=True, metavar="SPEC",
                   help="A100-40GB, A100-80GB, H100-SXM, H200, B200, GB200, this-machine (calibrated by bench matmul "
                        "and bench comm; its compute by bench plan), or a TOML file")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs (processes); default: the layout's product, or one node")
    p.add_argument("--mfu", type=float, metavar="X", help="an achieved MFU (0-1: model FLOPs over the peak) instead "
                                                          "of the modelled step time")
    p.add_argument("--tflops", type=float, metavar="X", help="an achieved model TFLOP/s per GPU (the MFU convention: "
                                                             "PaLM, Llama 3) instead of the modelled step time")
    p.add_argument("--hfu", type=float, metavar="X", help="an achieved HFU (0-1: hardware FLOPs, recomputation "
                                                          "included, over the peak)")
    p.add_argument("--hfu-tflops", type=float, metavar="X", help="an achieved hardware TFLOP/s per GPU, recomputation "
                                                                 "included (Megatron's published rates)")
    p.add_argument("--tokens", metavar="N", help="tokens to train on (e.g. 15T, 300B, 2e12; positive and finite): "
                                                 "prints the days")
    p.add_argument("--moe-imbalance", type=float, metavar="X", help="mixture of experts: the busiest rank's routed "
                                                                    "slots over the average (default 1: balanced)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table (strict JSON: a value "
                                                       "that is not finite is null)")
    p.add_argument("--search", action="store_true", help="list the fastest layouts that fit (model, batch, "
                                                          "sequence and precision as configured)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="--search: how many layouts (default 10)")
    _with_config(p)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="Hugging Face models in and out (Llama, Mistral, Qwen2/3, Mixtral, "
                                       "Qwen3-MoE, Phi-3, Gemma 2: docs/hf.md)",
                       description="--from-hf DIR --to RUN_DIR: a run directory with a step-0 checkpoint of the HF "
                                   "weights, its tokenizer files and generation config (train from it with "
                                   "model.init_from=run:RUN_DIR). --to-hf RUN_DIR --out DIR: the run's newest good "
                                   "checkpoint as a HF model folder (model.safetensors, config.json, the tokenizer "
                                   "files with the chat template, generation_config.json), in the family and dtype "
                                   "the model came from (a LoRA run: the adapters merged, or with --adapter a PEFT adapter folder, docs/lora.md). "
                                   "Supported families and what is refused: docs/hf.md.")
    p.add_argument("--from-hf", metavar="DIR", help="a Hugging Face model folder (config.json, *.safetensors)")
    p.add_argument("--to", metavar="RUN_DIR", help="with --from-hf: the run directory to create (a new or empty "
                                                   "folder; another folder is refused)")
    p.add_argument("--to-hf", metavar="RUN_DIR", help="an ndtrain run directory (or one checkpoint folder)")
    p.add_argument("--out", metavar="DIR", help="with --to-hf: the HF model folder to write")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="--to-hf: the exported dtype (default: the dtype of the HF model the run came from, else fp32)")
    p.add_argument("--overwrite", action="store_true",
                   help="--to-hf: write into a non-empty --out, removing its weights, config and tokenizer files "
                        "first (without it a non-empty folder is refused)")
    p.add_argument("--adapter", action="store_true",
                   help="--to-hf of a LoRA run (lora.rank > 0): write only the adapters, as a PEFT adapter folder "
                        "(adapter_config.json, adapter_model.safetensors) for the base model; without it the "
                        "adapters are merged into the exported weights")


def _add_checkpoint(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect a run's checkpoints",
                       description="inspect DIR: the checkpoints of a run (or one checkpoint folder): steps, the "
                                   "layout that wrote them, the model, every tensor with its pieces, bytes per rank.")
    p.add_argument("action", choices=["inspect"])
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--verify", action="store_true", help="also check every file against its SHA-256")


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: matmul (CPU peak), dp (ours vs torch DDP), "
                                     "tp (ours vs DTensor TP+SP over --nproc ranks), zero (our ZeRO-3 vs torch FSDP2), "
                                     "pp (our 1F1B, interleaved, zero bubble vs torch.distributed.pipelining; "
                                     "bubbles), cp (ring vs allgather vs ulysses vs 1 process at two sequence lengths), "
                                     "comm (every collective's bus bandwidth, our ring all-reduce vs the backend's), "
                                     "sft (packed vs padded fine-tuning rows), checkpoint (our save/load vs "
                                     "torch.distributed.checkpoint, MB/s; then the training stall per save, sync vs "
                                     "run.async_save, last line their ratio, lower is better), ep (experts split over --nproc ranks vs "
                                     "replicated), generate (KV cache vs recomputing the prefix, one process), "
                                     "plan (the planner's step time against the engine's, each layout on this "
                                     "machine), fp8 (bf16 vs each fp8 recipe, MXFP8 and NVFP4; on a CPU, the emulation), muon (AdamW vs "
                                     "train.optimizer=muon under dp and ZeRO-3: step time and bytes), compile "
                                     "(train.compile=true vs eager, same layout), prepare (ndtrain prepare on "
                                     "data.workers processes vs a bare tokenizers encode_batch loop, MB/s), ft (one replica group "
                                     "killed mid-run: run.fault_tolerance=restart vs replicas, wall time and steps lost; "
                                     "default 2 rounds), gpu (the "
                                     "one-GPU acceptance run: CUDA tests, 1B MFU eager/compiled, one-GPU benches; "
                                     "--dry-run lists them), rl (synchronous RL on --nproc ranks vs asynchronous: "
                                     "--nproc - 1 training, 1 generator process, staleness 1; whole jobs alternated, "
                                     "default 3 rounds; the ratio is async/sync wall time per update); "
                                     "KEY=VALUE reaches both sides or is refused",
                       description="Run ndtrain and its PyTorch-native anchor side by side (sft: packed and padded "
                                   "rows), alternating rounds; the last line is the ratio of their median "
                                   "throughputs. Every key a benchmark accepts (model.*, train.precision, "
                                   "train.recompute, train.micro_batch, ...) reaches both sides; others are refused. "
                                   "docs/benchmarks.md lists the settings of each side.")
    p.add_argument("what", choices=["matmul", "dp", "tp", "zero", "pp", "cp", "comm", "sft", "lora", "checkpoint", "ep",
                                    "generate", "plan", "fp8", "muon", "compile", "prepare", "ft", "gpu", "rl"])
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks for distributed benchmarks")
    p.add_argument("--dry-run", action="store_true", help="gpu: print the steps and their time budgets, run nothing")
    p.add_argument("--rounds", type=int, help="alternating A/B rounds (default 10; generate 5)")
    p.add_argument("--steps", type=int, help="timed steps per round (default 3; generate 1: one whole generation)")
    p.add_argument("--out", metavar="DIR", help="pp: draw each schedule's timeline into DIR; "
                                               "comm: the picture and figures (default runs/bench-comm-<date>); "
                                               "checkpoint: write the checkpoints there (default: a temporary folder); "
                                               "a new or empty folder, or an ndtrain run's")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out that is not an ndtrain run, "
                                                            "beside (and over) its files")
    p.add_argument("--only", metavar="PREFIX[,PREFIX]", help="plan: only the layouts whose name starts with one "
                                                            "of these, e.g. pp (every pipeline schedule); gpu: only "
                                                            "the steps whose name starts with one, e.g. '1B' or "
                                                            "'CUDA tests'")
    p.add_argument("--sizes", nargs="+", metavar="SIZE", help="comm: message sizes, e.g. 1K 4M 64M "
                                                              "(default 1 KB to 256 MB by powers of 4)")
    _with_config(p)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ndtrain", description="N-D parallel training of transformer language models.",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"ndtrain {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_train, _add_sft, _add_rl, _add_dpo, _add_prepare, _add_generate, _add_trace, _add_plan,
                _add_convert, _add_checkpoint, _add_bench):
        add(sub)
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but KEY=VALUE overrides may stand anywhere, also after options."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or "=" in argv[0]:
        argv = ["train"] + argv
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    args.argv = argv  # the command line, for the command that continues a stopped run
    return args
