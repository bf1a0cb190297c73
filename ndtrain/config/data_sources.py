"""`data.sources`: a weighted mixture of sources (`[[data.sources]]` tables in TOML, or a
JSON list on the command line), each read into the same plain dict. docs/data.md."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ndtrain.config.schema import ConfigError

SOURCE_KEYS = {"name": str, "path": str, "weight": (int, float), "text_key": str, "repeat": bool}
NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # it names metrics: source_tokens.<name>, val_loss.<name>


def coerce_sources(value: Any, from_text: bool) -> list[dict]:
    """The sources as plain dicts with every key: name (default: the path's stem), path,
    weight (default 1), text_key ("" = data.jsonl_key), repeat (default true)."""
    if from_text:
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise ConfigError("data.sources", value, "on the command line, a JSON list of tables, e.g. "
                              "'[{\"path\": \"web/\", \"weight\": 0.7}, {\"path\": \"code.jsonl.zst\", "
                              "\"weight\": 0.3}]' (or [[data.sources]] tables in the TOML file)") from None
    if not isinstance(value, list):
        raise ConfigError("data.sources", value, "expected a list of tables ([[data.sources]] in TOML)")
    return [_coerce_source(i, item) for i, item in enumerate(value)]


def _coerce_source(i: int, item: Any) -> dict:
    key = f"data.sources[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(key, item, "expected a table with path (and name, weight, text_key, repeat)")
    for k, v in item.items():
        if k not in SOURCE_KEYS:
            raise ConfigError(f"{key}.{k}", v, f"unknown key; a source has {', '.join(SOURCE_KEYS)}")
        kind = SOURCE_KEYS[k]
        if not isinstance(v, kind) or (kind != bool and isinstance(v, bool)):
            what = {str: "a string", bool: "true or false"}.get(kind, "a number")
            raise ConfigError(f"{key}.{k}", v, f"expected {what}")
    if "path" not in item:
        raise ConfigError(f"{key}.path", "", "every source needs a path")
    stem = Path(item["path"].rstrip("/")).name.split(".")[0]
    return {"name": item.get("name", re.sub(r"[^A-Za-z0-9_-]", "_", stem) or f"source{i}"),
            "path": item["path"], "weight": float(item.get("weight", 1.0)),
            "text_key": item.get("text_key", ""), "repeat": item.get("repeat", True)}


def check_sources(sources: list[dict], path_explicit: bool, check_paths: bool) -> None:
    """Names unique and usable in metric names, weights finite and > 0 (they are relative:
    normalised to sum 1), paths that exist; not together with an explicit data.path."""
    if not sources:
        return
    if path_explicit:
        raise ConfigError("data.path", "set", "give data.path or [[data.sources]], not both (one path is a "
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
