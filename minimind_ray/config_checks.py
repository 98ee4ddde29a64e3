"""Config checks that need no config class: reading a YAML recipe, and the field bounds.

Kept apart from config.py so that the dataclasses there stay one screen per section. Every
refusal is a :class:`ConfigError` whose one line names the file (and line) or the field.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import operator
import os
import re
from typing import Any, Callable, Dict, Optional

import yaml
from omegaconf import AnyNode, DictConfig, ListConfig, OmegaConf


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



def require_extra(module: str, extra: str, field_name: str, what: str) -> None:
    """Refuse with one line naming the extra to install (pyproject.toml's optional-dependencies) unless ``module``
    can be imported: ``<field>: <what> needs <module>: pip install 'minimind-ray[<extra>]'``."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install of it counts as missing
        found = False
    need(found, field_name, f"{what} needs {module}, which is not installed here: pip install 'minimind-ray[{extra}]'")

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
    """The 1-based line where ``dotted_key`` (``eval.tasks[0].data`` too) or the deepest part of it that exists is
    written."""
    line, node = None, root
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", dotted_key):
        if part.startswith("[") and isinstance(node, yaml.SequenceNode) and int(part[1:-1]) < len(node.value):
            node = node.value[int(part[1:-1])]
            line = node.start_mark.line + 1
            continue
        match = [(k, v) for k, v in (node.value if isinstance(node, yaml.MappingNode) else [])
                 if getattr(k, "value", None) == part]
        if not match:
            break
        line, node = match[0][0].start_mark.line + 1, match[0][1]
    return line


# --------------------------------------------------------------------------- a user's layer against the schema


def _is_section(node: Any) -> bool:
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def _helps(node: DictConfig) -> Dict[str, str]:
    """{field: its help line} of a section."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(OmegaConf.get_type(node))}


def _names(node: DictConfig, prefix: str = "") -> Dict[str, str]:
    """{dotted name: help} of every field and section under ``node``."""
    out = {}
    for k, text in _helps(node).items():
        out[prefix + k] = text
        if _is_section(node._get_node(k)):
            out.update(_names(node._get_node(k), f"{prefix}{k}."))
    return out


def _words(text: str) -> set:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if len(w) > 1}


def nearest_field(key: str, section: DictConfig, prefix: str, root: Optional[DictConfig] = None) -> Optional[str]:
    """The field a mistyped ``key`` of the section at ``prefix`` most likely meant, by its dotted name: a close name
    in the same section, the same name in another section (``train.max_seq_len`` -> ``data.max_seq_len``), a name
    close to it anywhere, or a field whose name or help line holds the key's words (``model.layers`` ->
    ``model.num_hidden_layers``; ``train.learning_rate`` -> ``train.lr``, "peak learning rate")."""
    here = _helps(section)
    everywhere = _names(root) if root is not None else {prefix + k: v for k, v in here.items()}
    leaf_of = {name: name.rsplit(".", 1)[-1] for name in everywhere}
    close = difflib.get_close_matches(key, here, 1, 0.75)
    if close:
        return prefix + close[0]
    same = sorted((n for n, leaf in leaf_of.items() if leaf == key), key=len)
    if same:
        return same[0]
    close = difflib.get_close_matches(key, here, 1, 0.6)
    if close:
        return prefix + close[0]
    close = difflib.get_close_matches(key, set(leaf_of.values()), 1, 0.8)
    if close:
        return min((n for n, leaf in leaf_of.items() if leaf == close[0]), key=len)
    words = _words(key)  # its words in a field's name (model.layers -> model.num_hidden_layers), then in its help
    for pool in ({prefix + k: v for k, v in here.items()}, everywhere):
        for text_of in (lambda n: leaf_of.get(n, n.rsplit(".", 1)[-1]), lambda n: pool[n]):
            hits = sorted((n for n in pool if words and words <= _words(text_of(n))), key=len)
            if hits:
                return hits[0]
    return None


def conform(schema: DictConfig, layer: Any, where: Callable[[str], str] = lambda key: "") -> DictConfig:
    """A user's layer (a recipe, or the command line's dotted overrides) checked against ``schema`` and shaped to it:
    - one value where the field is a list (``data.train_path=x.jsonl``, ``data.train_path: /data/*.jsonl``) is a list
      of that one value, and one mapping where it is a list of entries (``eval.tasks: {task: mc, ...}``) a list of it;
    - a key that is no field is refused with the nearest field by its dotted name (:func:`nearest_field`): ``train.
      learning_rate: no such field in train; did you mean train.lr?``;
    - a value given for a section, or a section for a value, is refused naming it.
    Messages name fields by their dotted names, never a class; ``where(dotted key)`` prefixes them (file:line)."""
    plain = OmegaConf.to_container(layer, resolve=False) if isinstance(layer, (DictConfig, ListConfig)) else layer
    return OmegaConf.create(_conform(schema, plain or {}, "", schema, where))


def _refuse(where: Callable[[str], str], key: str, msg: str) -> ConfigError:
    place = where(key)
    return ConfigError(f"{place}: {key}: {msg}" if place else f"{key}: {msg}")


def _conform(node: Any, value: Any, key: str, root: Optional[DictConfig], where: Callable[[str], str]) -> Any:
    if _is_section(node):
        if value is None:
            return value
        if not isinstance(value, dict):
            fields = ", ".join(f"{key}.{k}" for k in list(_helps(node))[:4])
            raise _refuse(where, key or "the config", f"is a section, not a value: set its fields ({fields}, ...)")
        out = {}
        for k, v in value.items():
            sub = f"{key}.{k}" if key else str(k)
            if k not in _helps(node):
                guess = nearest_field(str(k), node, f"{key}." if key else "", root)
                inside = f"in {key}" if key else "at the top level (model, data, train, ...)"
                hint = f"did you mean {guess}?" if guess else "--help lists every field"
                raise _refuse(where, sub, f"no such field {inside}; {hint}")
            out[k] = _conform(node._get_node(k), v, sub, root, where)
        return out
    if isinstance(node, ListConfig):
        element = node._metadata.element_type
        entry = OmegaConf.structured(element) if dataclasses.is_dataclass(element) else None
        if value is None or isinstance(value, str) and value.startswith("${"):
            return value
        if not isinstance(value, list):
            if entry is not None and not isinstance(value, dict):
                fields = ", ".join(list(_helps(entry))[:3])
                raise _refuse(where, key, f"a list of entries with fields {fields}, ..., not {value!r}")
            value = [value]
        if entry is None:
            return value
        return [_conform(entry, v, f"{key}[{i}]", None, where) for i, v in enumerate(value)]
    if isinstance(value, dict) and not isinstance(node, (DictConfig, AnyNode)):
        raise _refuse(where, key, "is a value, not a section")
    return value


def omegaconf_message(e: Exception) -> str:
    """One line of an OmegaConf error, naming the key, without its class names (``TrainConfig`` -> a section)."""
    msg = str(e).splitlines()[0] if str(e) else repr(e)
    msg = re.sub(r"'?\b[A-Z]\w*Config\b'?", "a section", msg)
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


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
        def where(key: str) -> str:
            line = _line_of(root, key)
            return f"{path}:{line}" if line else path

        loaded = conform(schema, loaded, where)  # a key that is no field names the nearest, with its line
        try:
            OmegaConf.merge(schema, loaded)
        except Exception as e:  # omegaconf's errors: a value of the wrong type
            key = getattr(e, "full_key", None)
            msg = omegaconf_message(e)
            raise ConfigError(f"{where(key) if key else path}: {msg}") from None
    return loaded
