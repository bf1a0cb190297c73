"""`ndtrain convert` (Hugging Face models in and out) and `ndtrain checkpoint inspect`."""

from __future__ import annotations

import sys
from pathlib import Path


def cmd_convert(args) -> int:
    from ndtrain.checkpoint.convert import from_hf, to_hf
    from ndtrain.config import ConfigError, check_run_folder, check_writable_dir
    if args.adapter and not args.to_hf:
        raise ConfigError("--adapter", True, "goes with --to-hf RUN_DIR --out DIR")
    if bool(args.from_hf) == bool(args.to_hf):
        raise ConfigError("convert", "--from-hf / --to-hf", "give exactly one of --from-hf DIR --to RUN_DIR "
                          "and --to-hf RUN_DIR --out DIR")
    if args.from_hf:
        if not args.to:
            raise ConfigError("--to", None, "--from-hf needs --to RUN_DIR, the run directory to create")
        if not Path(args.from_hf).is_dir():
            raise ConfigError("--from-hf", args.from_hf, "directory does not exist")
        check_writable_dir("--to", args.to)
        check_run_folder("--to", args.to)
        path = from_hf(Path(args.from_hf), Path(args.to))
        print(f"converted {args.from_hf} → {path}\ntrain from it with  ndtrain train model.init_from=run:{args.to}")
        return 0
    if not args.out:
        raise ConfigError("--out", None, "--to-hf needs --out DIR, the Hugging Face folder to write")
    if not Path(args.to_hf).is_dir():
        raise ConfigError("--to-hf", args.to_hf, "directory does not exist")
    out = to_hf(Path(args.to_hf), Path(args.out), args.dtype,
                report=lambda m: print(f"ndtrain: {m}", file=sys.stderr), overwrite=args.overwrite,
                adapter=args.adapter)
    if args.adapter:
        print(f"exported the adapters of {args.to_hf} → {out} (peft.PeftModel.from_pretrained(base, {str(out)!r}))")
    else:
        print(f"exported {args.to_hf} → {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_checkpoint(args) -> int:
    from ndtrain.checkpoint.inspect import describe
    from ndtrain.config import ConfigError
    from ndtrain.checkpoint.store import CheckpointError
    if not Path(args.dir).is_dir():
        raise ConfigError("DIR", args.dir, "directory does not exist")
    try:
        text = describe(Path(args.dir), verify=args.verify)
    except CheckpointError as e:  # the folder given is no checkpoint we can read: bad input
        raise ConfigError("DIR", args.dir, str(e)) from None
    print(text)
    return 0
