"""Config checks that need no config class: reading a YAML recipe, and the field bounds.

Kept apart from config.py so that the dataclasses there stay one screen per section. Every
refusal is a :class:`ConfigError` whose one line names the file (and line) or the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import operator
import os
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """An invalid config value; the message names the field (and the file, for a recipe's own errors)."""


def config_field(default: Any, help: str, **bounds):
    """A dataclass field with a one-line help text and its range, if any (gt/ge/lt/le; see check_bounds)."""
    meta = {"help": help, **bounds}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: the form MLflow params take."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def int_at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse then names the option and exits 2)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def need(cond: bool, field_name: str, msg: str) -> None:
    """Refuse with ``<field>: <msg>`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


# field metadata key -> (test, how the message writes it); a field carries these through config._f
BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"), "le": (operator.le, "<=")}


def check_bounds(section: Any, prefix: str = "") -> None:
    """Refuse the first field (depth first) whose value is outside its ``gt``/``ge``/``lt``/``le`` bounds.
    None means "unset" and passes; NaN fails every bound."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_bounds(value, f"{prefix}{f.name}.")
            continue
        bounds = [(k, f.metadata[k]) for k in BOUNDS if k in f.metadata]
        if value is not None and not all(BOUNDS[k][0](value, b) for k, b in bounds):
            rule = " and ".join(f"{BOUNDS[k][1]} {b}" for k, b in bounds)
            raise ConfigError(f"{prefix}{f.name}: must be {rule}, got {value!r}")


def _yaml_error(path: str, e: yaml.YAMLError) -> ConfigError:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    ctx, ctx_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if ctx and ctx_mark is not None:  # e.g. an unclosed bracket: where it was opened
        problem += f" ({ctx} at line {ctx_mark.line + 1}, column {ctx_mark.column + 1})"
    return ConfigError(f"{where}: invalid YAML: {problem}")


def _compose(path: str) -> Optional[yaml.Node]:
    """The file's YAML node tree (None when empty), which keeps every key's line."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.compose(f, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: unreadable ({e.strerror or e})") from None


def _line_of(root: Optional[yaml.Node], dotted_key: str) -> Optional[int]:
    """The 1-based line where ``dotted_key`` (or the deepest part of it that exists) is written."""
    line, node = None, root
    for part in dotted_key.split("."):
        match = [(k, v) for k, v in (node.value if isinstance(node, yaml.MappingNode) else [])
                 if getattr(k, "value", None) == part]
        if not match:
            break
        line, node = match[0][0].start_mark.line + 1, match[0][1]
    return line


def read_yaml(path: str, schema: Optional[DictConfig] = None) -> DictConfig:
    """A YAML recipe as an OmegaConf mapping. Refused, naming the file: absent, unreadable, not YAML
    (with line:column), not a mapping at the top, or (against ``schema``) a key that is not a field
    or a value of the wrong type (with the key's line)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}" if not os.path.exists(path) else f"{path}: not a file")
    root = _compose(path)
    if root is not None and not isinstance(root, yaml.MappingNode):
        kind = "list" if isinstance(root, yaml.SequenceNode) else f"scalar ({str(root.value)[:40]!r})"
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, train:, ...), "
                          f"not a {kind}")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:  # what the plain parse lets through, e.g. a duplicate key
        raise _yaml_error(path, e) from None
    if schema is not None:
        try:
            OmegaConf.merge(schema, loaded)
        except Exception as e:  # omegaconf's errors: an unknown key, a value of the wrong type
            msg = str(e).splitlines()[0] if str(e) else repr(e)
            key = getattr(e, "full_key", None)
            line = _line_of(root, key) if key else None
            where = f"{path}:{line}" if line else path
            raise ConfigError(f"{where}: {key}: {msg}" if key and key not in msg else f"{where}: {msg}") from None
    return loaded
