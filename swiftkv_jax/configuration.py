"""Typed, frozen run configs: YAML recipes plus `section.key=value` overrides, validated.

A config is a tree of frozen dataclasses. Every leaf is addressed by its dotted key (`optim.learning_rate`); unknown
keys fail with the nearest valid key, values are coerced to the field's type or rejected, and
`describe` lists every key with its type, default and help for `--help`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


def field(default, help: str = "", **kwargs):
    """A dataclass field with a help string (shown by `describe`)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a default_factory for mutable defaults")
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional_inner(tp):
    """X for Optional[X], else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} | null"
    if typing.get_origin(tp) is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _yaml(text: str, key: str):
    """A command-line value read as YAML (lists, mappings, numbers); malformed YAML names its key."""
    try:
        return yaml.load(text, _UniqueKeyLoader)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{key}: {text!r} is not valid YAML ({problem}): check its brackets, and quote a value "
                          f"that holds ',', ': ' or ' #'") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error: PyYAML keeps the last silently, so a
    second `optim:` section dropped the first one's settings."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):  # the loader's own error names it
                continue
            if key in seen:
                lines = f"lines {seen[key] + 1} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice ({lines}): merge the "
                                                        f"two into one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _coerce(value, tp, key: str, from_text: bool, where: str = ""):
    """`value` as type `tp`; text overrides are parsed per the target type."""
    fail = lambda why="": ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}{why}")
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (from_text and str(value).lower() in ("null", "none", "~")):
            return None
        return _coerce(value, inner, key, from_text, where)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}{hint}")
        return value
    if origin is tuple:
        if from_text:
            value = _yaml(value, key)
        if isinstance(value, dict) or not isinstance(value, (list, tuple)):
            value = [value]
        item = typing.get_args(tp)[0]
        return tuple(_coerce(v, item, f"{key}[{i}]", False, where) for i, v in enumerate(value))
    if _is_config(tp):
        if from_text:
            value = _yaml(value, key)
        if not isinstance(value, dict):
            raise fail(" (a mapping of its keys)")
        return from_dict(tp, value, prefix=key + ".", where=where)
    if tp is bool:
        if from_text:
            value = _yaml(value, key)
        if not isinstance(value, bool):
            raise fail()
        return value
    if tp is int:
        if from_text:
            value = _yaml(value, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
        return value
    if tp is float:
        if isinstance(value, bool):
            raise fail()
        try:  # YAML 1.1 reads "1e-4" as text
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise fail() from None
        if not math.isfinite(number):  # no setting takes inf or nan: they failed later, in the step or its schedule
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            if from_text or isinstance(value, bool) or value is None:
                raise fail()
            value = str(value)
        return value
    raise TypeError(f"{key}: unsupported field type {tp!r}")


# Names other trainers give our keys (Hugging Face TrainingArguments, optax, MaxText): "did you mean" follows these
# before spelling, which would offer optim.b2 for optim.lr.
KEY_ALIASES = {"lr": "learning_rate", "beta1": "b1", "adam_beta1": "b1", "beta2": "b2", "adam_beta2": "b2",
               "epsilon": "eps", "adam_epsilon": "eps", "adam_eps": "eps", "max_grad_norm": "grad_clip",
               "gradient_clipping": "grad_clip", "clip_grad_norm": "grad_clip",
               "gradient_accumulation_steps": "grad_accum", "num_train_epochs": "epochs",
               "max_train_steps": "max_steps", "steps": "max_steps", "logging_steps": "log_every",
               "save_steps": "every", "save_total_limit": "keep", "batch_size": "global_batch_size"}


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    section, _, leaf = key.rpartition(".")
    siblings = [k for k in valid if k.rpartition(".")[0] == section]
    alias = KEY_ALIASES.get(leaf.lower())
    close = [k for k in siblings if alias and k.rpartition(".")[2] == alias]
    close = close or [k for k in valid if alias and k.rpartition(".")[2] == alias]
    close = close or [f"{section}.{m}" if section else m for m in difflib.get_close_matches(
        leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.6)]
    close = close or difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys here: {', '.join(siblings or valid)}"
    return ConfigError(f"unknown config key {key!r}{where}{hint} (see --help)")


def from_dict(cls, values: dict, prefix: str = "", where: str = ""):
    """`cls` built from a nested mapping; every key checked, every value coerced."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in values.items():
        if name not in hints:
            raise _unknown_key(prefix + str(name), [prefix + n for n in names], where)
        kwargs[name] = _coerce(value, hints[name], prefix + name, False, where)
    required = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ConfigError(f"{', '.join(prefix + n for n in required)} is required{where} (see --help)")
    try:
        return cls(**kwargs)
    except TypeError as e:  # whatever else the constructor refuses (required fields are named above)
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def keys(cls, prefix: str = "") -> list[str]:
    """Every dotted leaf key of `cls`."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        out += keys(tp, f"{prefix}{f.name}.") if _is_config(tp) else [prefix + f.name]
    return out


def override(config, assignment: str):
    """`config` with one `dotted.key=value` applied (value parsed per the field's type). A mapping given for a section
    (`loss={temperature: 1.0}`) is merged into it, as the same keys under that section in the recipe would be: the
    section's other settings stay."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    key, text = assignment.split("=", 1)
    key = key.strip()
    valid = keys(type(config))
    node, path = config, key.split(".")
    for depth, name in enumerate(path):
        if not dataclasses.is_dataclass(node) or name not in _hints(type(node)):
            raise _unknown_key(key, valid, "")
        if depth < len(path) - 1:
            node = getattr(node, name)
    tp = _hints(type(node))[path[-1]]
    if _is_config(tp):
        value = _yaml(text, key)
        if isinstance(value, dict):
            value = _merged(to_dict(getattr(node, path[-1])), value)
        return _replace_path(config, path, _coerce(value, tp, key, False))
    return _replace_path(config, path, _coerce(text, tp, key, True))


def _merged(base: dict, update: dict) -> dict:
    """`update` over `base`, section by section (a list, e.g. data.sources, replaces the recipe's whole)."""
    out = dict(base)
    for name, value in update.items():
        out[name] = _merged(out[name], value) if isinstance(value, dict) and isinstance(out.get(name), dict) else value
    return out


def _replace_path(node, path, value):
    if len(path) == 1:
        return dataclasses.replace(node, **{path[0]: value})
    return dataclasses.replace(node, **{path[0]: _replace_path(getattr(node, path[0]), path[1:], value)})


def load(cls, path=None, overrides=()):
    """`cls` from a YAML file (optional) and `key=value` overrides, in that order, then `cls.validate()`."""
    values = {}
    if path is not None:
        try:
            with open(path) as f:
                values = yaml.load(f, _UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory: give the recipe's .yaml file (see configs/)") \
                from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read ({getattr(e, 'strerror', None) or e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(values).__name__}")
    config = from_dict(cls, values, where=f" in {path}" if path else "")
    for assignment in overrides:
        config = override(config, assignment)
    if hasattr(config, "validate"):
        config.validate()
    return config


def to_dict(config) -> dict:
    """Plain nested dict (tuples as lists), for YAML/JSON output."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v
    return plain(config)


def describe(cls, prefix: str = "") -> str:
    """One line per key: `key  (type, default: value)  help`."""
    lines = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _is_config(tp):
            lines.append(describe(tp, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = yaml.safe_dump(to_dict(f.default) if isinstance(f.default, tuple) else f.default,
                                     default_flow_style=True).strip().removesuffix("...").strip()
        else:
            default = "required"
        help_text = f.metadata.get("help", "")
        lines.append(f"  {prefix + f.name:<34} {type_name(tp)} = {default}"
                     + (f"\n{'':38}{help_text}" if help_text else ""))
    return "\n".join(lines)
