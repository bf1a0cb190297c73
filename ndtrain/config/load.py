"""Reading a config: a TOML file and dotted KEY=VALUE overrides over the defaults
(`load_config`); writing one: the resolved config as TOML (`to_toml`, a run's config.toml).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from ndtrain.config.schema import Config, ConfigError, from_dict, set_key


def _read_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", str(path), "file does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("--config", str(path), f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError("--config", str(path), "is not a UTF-8 text file (a TOML config is text)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", str(path), f"not valid TOML ({e})") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = (),
                defaults: list[str] | tuple = ()) -> Config:
    """Defaults (the code's, then a command's own `defaults`, KEY=VALUE), then the TOML
    file, then KEY=VALUE overrides. Raises ConfigError. `cfg.explicit` holds the keys the
    file and the overrides set."""
    data: dict = _read_toml(path) if path is not None else {}
    cfg = from_dict(data, base=defaults)
    explicit = {f"{s}.{k}" for s, values in data.items() for k, v in values.items() if v is not None}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, item, "expected KEY=VALUE, e.g. train.steps=100")
        key, value = item.split("=", 1)
        set_key(cfg, key.strip(), value, from_text=True)
        explicit.add(key.strip())
    cfg.explicit = frozenset(explicit)
    cfg.given = {k: _value(cfg, k) for k in explicit}
    return cfg


def _value(cfg: Config, key: str):
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section, None), name, None)


# --------------------------------------------------------------------------- TOML output

def _toml_value(v: Any) -> str:
    if isinstance(v, list):  # data.sources: an array of inline tables
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def to_toml(cfg: Config) -> str:
    """The config as TOML. Keys whose value is None ("from the preset") are left out."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        out.append("")
    return "\n".join(out)
