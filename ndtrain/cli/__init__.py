"""The `ndtrain` command: train, sft, rl, dpo, prepare, generate, trace, plan, convert, checkpoint, bench.

`main` parses the command line (parser.py) and runs the command, each family in its own
module: train.py (train, prepare), posttrain.py (sft, rl, dpo), generate.py (generate, trace),
plan.py, checkpoint.py (convert, checkpoint) and bench.py; run.py holds what the training
commands share.

Bad input is refused before anything starts or is written: one line naming the key, the
value and the rule, exit status 2. A fault during a run names the rank and exits 1.
"""

from __future__ import annotations

import sys

from ndtrain.cli.bench import BENCH_ROUNDS_STEPS, cmd_bench
from ndtrain.cli.checkpoint import cmd_checkpoint, cmd_convert
from ndtrain.cli.generate import cmd_generate, cmd_trace
from ndtrain.cli.parser import EPILOG, build_parser, parse
from ndtrain.cli.plan import cmd_plan
from ndtrain.cli.posttrain import cmd_dpo, cmd_rl, cmd_sft, default_pretraining_run, default_warmup
from ndtrain.cli.run import Stopped, check_resume, open_data, print_summary, warn_before_start
from ndtrain.cli.train import cmd_prepare, cmd_train, dry_run

__all__ = [
    "BENCH_ROUNDS_STEPS", "EPILOG", "build_parser", "check_resume", "cmd_bench", "cmd_checkpoint", "cmd_convert", "cmd_dpo",
    "cmd_generate", "cmd_plan", "cmd_prepare", "cmd_rl", "cmd_sft", "cmd_trace", "cmd_train", "default_pretraining_run",
    "default_warmup", "dry_run", "fail", "main", "open_data", "parse", "print_summary", "warn_before_start",
]


def fail(message: str, code: int = 2) -> int:
    print(f"ndtrain: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    from ndtrain.launch import end_rank
    code = _main(argv)
    end_rank(code)  # a rank of torchrun or srun ends here, without the interpreter's finalization
    return code


def _main(argv: list[str] | None) -> int:
    args = parse(argv)
    from ndtrain.checkpoint.store import CheckpointError
    from ndtrain.config import ConfigError
    from ndtrain.data.shards import DataError
    from ndtrain.launch import RankFailure, release_groups
    from ndtrain.train.errors import TrainingError

    try:
        return {"train": cmd_train, "sft": cmd_sft, "rl": cmd_rl, "dpo": cmd_dpo, "prepare": cmd_prepare, "generate": cmd_generate,
                "bench": cmd_bench, "trace": cmd_trace, "convert": cmd_convert,
                "checkpoint": cmd_checkpoint, "plan": cmd_plan}[args.command](args)
    except (ConfigError, DataError) as e:
        return fail(str(e))
    except (CheckpointError, TrainingError) as e:  # a fault of the run in this process: one line, exit 1
        return fail(str(e), 1)
    except RankFailure as e:
        if e.traceback and not _known_fault(e.summary):
            print(e.traceback, file=sys.stderr)
        return fail(str(e), 2 if e.summary.startswith(("DataError", "ConfigError")) else 1)
    except Stopped as e:
        print(f"ndtrain: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt as e:  # a launch's ranks ended at once (supervisor: the signal as its argument)
        import signal
        signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
        return fail("interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}",
                    128 + int(signum))
    except Exception as e:  # a run of this process that stopped on a fault it names (trainer.TrainingError)
        trainer = sys.modules.get("ndtrain.train.trainer")
        if trainer is not None and isinstance(e, trainer.TrainingError):
            return fail(str(e), 1)
        raise
    finally:  # a rank of torchrun / srun: its process groups freed before the interpreter exits
        release_groups()


def _known_fault(summary: str) -> bool:
    return summary.startswith(("TrainingError", "DataError", "ConfigError", "CheckpointError", "CollectiveError"))
