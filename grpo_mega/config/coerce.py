"""YAML and command-line coercion for the typed run configuration (``grpo_mega.config``).

Generic over any dataclass of dataclass sections: it reads the field docstrings, parses
``--section.key=value`` overrides and converts each value to its field's annotation, so
that the schema in ``config.py`` stays a list of typed, documented fields. Imports nothing
of ours (``config`` imports it).

    apply_overrides(cfg, ["--parallel.tp=2"])
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import typing
from typing import Any, Collection

import yaml


class ConfigError(ValueError):
    """A config value is malformed or impossible; the message names the field."""


def yaml_error(e: yaml.YAMLError, source: str) -> ConfigError:
    """A PyYAML syntax error as one line naming ``source``, its line and column (1-based)
    and the problem; PyYAML's own message names ``<unicode string>`` and spans five lines."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    msg = f"{source}, {at(mark)}" if mark else source
    msg += f": not valid YAML: {problem or type(e).__name__}"
    if context:
        msg += f" ({context}{' at ' + at(context_mark) if context_mark else ''})"
    return ConfigError(msg)


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value
    return docs


# ------------------------------------------------------------------ type coercion

def type_name(tp: Any) -> str:
    """A field annotation as the docs and ``--help`` show it: ``int``, ``str or null``,
    ``list[str]``."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def sub_section(tp: Any) -> Any:
    """The dataclass of a field that is a nested section (``model.lora: Optional[LoraConfig]``),
    else None."""
    if typing.get_origin(tp) is typing.Union:
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), None)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _coerce_section(value: Any, cls: Any, where: str) -> Any:
    """A nested section from a mapping (YAML, or ``--model.lora='{rank: 4}'``): its defaults,
    then each key coerced to its field; unknown keys are errors."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError as e:
            raise yaml_error(e, where) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {value!r}")
    out, types = cls(), typing.get_type_hints(cls)
    for k, v in value.items():
        if k not in types:
            raise ConfigError(f"{where}: unknown field {k!r}; known: {sorted(types)}")
        setattr(out, k, _coerce(v, types[k], f"{where}.{k}"))
    return out


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert ``value`` to annotation ``tp``; strings from the CLI are parsed."""
    origin = typing.get_origin(tp)
    cls = sub_section(tp)
    if cls is not None and not (value is None or (isinstance(value, str) and value.lower() in ("null", "none"))):
        return _coerce_section(value, cls, where)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(value, args[0], where)
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
            except yaml.YAMLError as e:
                raise yaml_error(e, where) from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: not a YAML mapping ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {_coerce(k, key_tp, f"{where} key {k!r}"): _coerce(v, val_tp, f"{where}[{k!r}]")
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        # bool is an int to Python, never a count or a rate here; a float is no integer.
        accepted = (int, str) if tp is int else (int, float, str)
        if isinstance(value, accepted) and not isinstance(value, bool):
            try:
                return tp(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


# ------------------------------------------------------------------ the rule for numbers

def _numbers(value: Any, tp: Any) -> list:
    """The int/float values a field of annotation ``tp`` holds (Optional and lists unwrapped);
    None (a field's "off", e.g. ``tis_cap: null``) holds none."""
    origin = typing.get_origin(tp)
    if value is None:
        return []
    if origin is typing.Union:
        return _numbers(value, next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is list:
        return [x for v in value for x in _numbers(v, typing.get_args(tp)[0])]
    if tp in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return []


def check_numbers(cfg: Any, signed: Collection[str] = ()) -> None:
    """The one rule for every number of a config of dataclass sections: a float is finite
    (NaN passes every ``<``/``>`` check after it and poisons the run: a NaN learning rate,
    temperature or clip bound) and no number is negative (counts, sizes, rates, times and
    coefficients), except the ``section.key`` fields named in ``signed``, whose own checks
    bound them. Raises ConfigError naming the field and its flag."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        if not dataclasses.is_dataclass(section):
            continue
        fields = [(f"{sec.name}.{name}", getattr(section, name), tp)
                  for name, tp in _section_types(type(section)).items()]
        for key, value, tp in list(fields):
            if sub_section(tp) is not None and value is not None:  # a nested section's own fields
                fields += [(f"{key}.{n}", getattr(value, n), t) for n, t in _section_types(type(value)).items()]
        for key, value, tp in fields:
            for v in _numbers(value, tp):
                if not math.isfinite(v):
                    raise ConfigError(f"{key}={value!r} is not a finite number; NaN and infinity are "
                                      f"refused in every float field (--{key})")
                if v < 0 and key not in signed:
                    raise ConfigError(f"{key}={value!r} must be >= 0: a negative count, size, rate "
                                      f"or time limit has no meaning here (--{key})")


def _section_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def apply_dict(cfg: Any, data: dict, source: str) -> Any:
    """Merge a nested dict (from YAML) into ``cfg``; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections")
    sections = [f.name for f in dataclasses.fields(cfg)]
    for sec_name, values in data.items():
        if not isinstance(sec_name, str) or sec_name not in sections:
            raise ConfigError(f"{source}: unknown section {sec_name!r}; known: {sections}")
        section = getattr(cfg, sec_name)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {sec_name!r} must be a mapping")
        types = _section_types(type(section))
        for key, value in values.items():
            if not isinstance(key, str) or key not in types:
                raise ConfigError(f"{source}: unknown field {sec_name}.{key}; known: {sorted(types)}")
            setattr(section, key, _coerce(value, types[key], f"{sec_name}.{key} (in {source})"))
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``['--a.b=1', '--c.d', '2']`` -> ``[('a.b', '1'), ('c.d', '2')]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"unrecognised argument {arg!r}; overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value (use {arg}=VALUE)")
            key, value = arg[2:], args[i + 1]
            i += 1
        out.append((key, value))
        i += 1
    return out


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    for key, value in parse_overrides(overrides):
        sec_name, _, name = key.partition(".")
        section = getattr(cfg, sec_name, None)
        if section is None or not dataclasses.is_dataclass(section):
            raise ConfigError(f"--{key}: unknown section {sec_name!r}")
        types = _section_types(type(section))
        name, _, leaf = name.partition(".")
        if name not in types:
            raise ConfigError(f"--{key}: unknown field; {sec_name} has {sorted(types)}")
        cls = sub_section(types[name])
        if leaf and cls is not None:
            # --model.lora.rank=4: one field of a nested section, which the flag turns on
            sub = getattr(section, name) or cls()
            sub_types = _section_types(cls)
            if leaf not in sub_types:
                raise ConfigError(f"--{key}: unknown field; {sec_name}.{name} has {sorted(sub_types)}")
            setattr(sub, leaf, _coerce(value, sub_types[leaf], f"{key} (from --{key})"))
            setattr(section, name, sub)
            continue
        if leaf:
            raise ConfigError(f"--{key}: {sec_name}.{name} has no fields of its own")
        setattr(section, name, _coerce(value, types[name], f"{key} (from --{key})"))
    return cfg


def sections_help(config_cls: type) -> str:
    """``--help`` text: every field of every section of ``config_cls`` with its type,
    default and docstring."""
    lines = ["Config fields (override with --section.key=value; types, defaults and allowed values:",
             "docs/reference/config.md). Every float must be finite and no number negative, unless",
             "its field says so:"]
    for sec in dataclasses.fields(config_cls):
        cls = sec.default_factory().__class__
        docs, types = field_docs(cls), typing.get_type_hints(cls)
        lines.append(f"\n[{sec.name}]")
        for f in dataclasses.fields(cls):
            default = getattr(sec.default_factory(), f.name)
            lines.append(f"  --{sec.name}.{f.name} ({type_name(types[f.name])}, default {default!r}): "
                         f"{docs.get(f.name, '')}")
            sub = sub_section(types[f.name])
            if sub is not None:
                sub_docs, sub_types = field_docs(sub), typing.get_type_hints(sub)
                for g in dataclasses.fields(sub):
                    lines.append(f"  --{sec.name}.{f.name}.{g.name} ({type_name(sub_types[g.name])}, default "
                                 f"{getattr(sub(), g.name)!r}; setting it turns {f.name} on): {sub_docs.get(g.name, '')}")
    return "\n".join(lines)
