"""`data.sources`: the checks of a weighted mixture's sources (schema.coerce_sources reads
them: `[[data.sources]]` tables in TOML, or a JSON list on the command line). docs/data.md."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from ndtrain.config.schema import ConfigError

NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # it names metrics: source_tokens.<name>, val_loss.<name>


def check_sources(sources: list[dict], path: str, check_paths: bool, explicit: frozenset = frozenset()) -> None:
    """Names unique and usable in metric names, weights finite and > 0 (they are relative:
    normalised to sum 1), paths that exist; not together with a data.path (other than the
    default, which a run's config.toml writes out). An empty list given on purpose is a
    mistake (it would train on the embedded corpus), unless data.path is given with it, as a
    run's config.toml writes both. `explicit`: the keys the file and the overrides set."""
    if not sources:
        if "data.sources" in explicit and "data.path" not in explicit:
            raise ConfigError("data.sources", [], "lists no source; give at least one [[data.sources]] table (name, "
                              "path, weight), or data.path for one source, or neither for the embedded corpus")
        return
    if path != "stdlib":
        raise ConfigError("data.path", path, "give data.path or [[data.sources]], not both (one path is a "
                          "mixture of one source)")
    seen = set()
    for i, s in enumerate(sources):
        key = f"data.sources[{i}]"
        if not NAME.match(s["name"]):
            raise ConfigError(f"{key}.name", s["name"], "use letters, digits, _ and - only (it names metrics)")
        if s["name"] in seen:
            raise ConfigError(f"{key}.name", s["name"], "another source has this name; names must differ")
        seen.add(s["name"])
        if not math.isfinite(s["weight"]) or s["weight"] <= 0:
            raise ConfigError(f"{key}.weight", s["weight"], "must be a finite number > 0 (weights are relative "
                              "shares, normalised to sum 1)")
        if check_paths and not Path(os.path.expanduser(s["path"])).exists():
            raise ConfigError(f"{key}.path", s["path"], "path does not exist")


def source_weights(sources: list[dict]) -> list[float]:
    """The weights normalised to sum 1: each source's share of the trained tokens."""
    total = sum(s["weight"] for s in sources)
    return [s["weight"] / total for s in sources]
