"""Load a config dataclass tree from TOML, apply CLI overrides, and expose every field as a CLI flag.

A field `grpo.group_size` is the TOML key `group_size` in table `[grpo]` and the flag `--group-size`.
Field names are unique across tables so that flags need no prefix. Help texts are the fields'
docstrings (the string literal under each field).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import tomllib
import typing
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from p2p.config import ConfigError, read_toml


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass `cls` to the docstring written under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = after.value.value.strip()
    return docs


def sections(root_cls: type) -> dict[str, type]:
    """The component tables of a root config class: {table name: dataclass}."""
    hints = typing.get_type_hints(root_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(root_cls)}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check (and convert CLI strings) `value` against the field type `hint`, or raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: must be a string, got {value!r}")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}: must be a table of key = value pairs, got {value!r}")
    raise TypeError(f"unsupported config type {hint} for {key}")


def table_values(cls: type, table: object, name: str, source: object) -> dict[str, Any]:
    """The fields of dataclass `cls` given in TOML table `name` of `source`, type-checked: an unknown key
    or a wrong type is a one-line error naming the key as `name.key`."""
    if not isinstance(table, dict):
        raise ConfigError(f"{name} in {source}: must be a table of key = value pairs")
    hints = typing.get_type_hints(cls)
    bad = sorted(set(table) - set(hints))
    if bad:
        raise ConfigError(f"unknown key {name}.{bad[0]} in {source}; allowed: {', '.join(hints)}")
    return {k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in table.items()}


def load_config(root_cls: type, path: str | Path | None, overrides: dict[str, Any]) -> Any:
    """Defaults, then the TOML file, then CLI overrides ({field name: value}); validated."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, "config file")
    return build_config(root_cls, data, overrides, path)


def build_config(root_cls: type, data: dict[str, Any], overrides: dict[str, Any], source: object) -> Any:
    """Defaults, then `data` ({table: {key: value}}, read from `source`), then overrides; validated."""
    tables = sections(root_cls)
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ConfigError(f"unknown table [{unknown[0]}] in {source}; allowed: {', '.join(tables)}")
    built = {}
    for name, cls in tables.items():
        hints = typing.get_type_hints(cls)
        values = table_values(cls, data.get(name, {}), name, source)
        for key, value in overrides.items():
            if key in hints and value is not None:
                values[key] = _coerce(f"{name}.{key} (--{key.replace('_', '-')})", value, hints[key])
        built[name] = cls(**values)
    config = root_cls(**built)
    config.validate()
    return config


def parse_key_values(items: list[str], flag: str) -> dict[str, Any]:
    """`["a=1", "b=x"]` -> {"a": 1, "b": "x"}; values are read as TOML scalars when they parse as such."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


# typed metavars, but values parsed by _coerce: a bad value is our one-line error naming the config field
METAVARS: dict[Any, tuple[str, Any]] = {int: ("INTEGER", str | None), float: ("FLOAT", str | None)}


def with_config_flags(root_cls: type) -> Callable[[Callable], Callable]:
    """Decorate a typer command so it also takes one option per config field, passed as `overrides`.

    The command function must accept `overrides: dict`. Options default to None (= not given).
    """

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "overrides"]
        extra = []
        names = []
        for table, cls in sections(root_cls).items():
            docs, defaults = field_docs(cls), cls()
            for name, hint in typing.get_type_hints(cls).items():
                flag = "--" + name.replace("_", "-")
                panel = escape(f"[{table}] table")  # rich reads an unescaped [run] as markup and drops it
                doc = escape(docs.get(name, ""))
                value = getattr(defaults, name)
                default = escape(f" [default: {str(value).lower() if isinstance(value, bool) else value}]")
                if hint is bool:
                    option = typer.Option(None, f"{flag}/--no-{flag[2:]}", help=doc + default, rich_help_panel=panel)
                    annotation: Any = bool | None
                elif hint is dict or typing.get_origin(hint) is dict:
                    option = typer.Option(None, flag, help=doc + " (repeatable)", rich_help_panel=panel)
                    annotation = list[str] | None
                else:
                    metavar, annotation = METAVARS.get(hint, ("TEXT", str | None))
                    if typing.get_origin(hint) is typing.Literal:
                        metavar = "|".join(map(str, typing.get_args(hint)))
                    option = typer.Option(None, flag, help=doc + default, metavar=metavar, rich_help_panel=panel)
                extra.append(
                    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
                )
                names.append((name, hint))

        def wrapper(**kwargs: Any) -> Any:
            overrides = {}
            for name, hint in names:
                value = kwargs.pop(name)
                if value is not None and (hint is dict or typing.get_origin(hint) is dict):
                    value = parse_key_values(value, "--" + name.replace("_", "-")) if value else None
                overrides[name] = value
            return func(overrides=overrides, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=own + extra)  # type: ignore[attr-defined]
        wrapper.__name__ = func.__name__
        wrapper.__doc__ = func.__doc__
        return wrapper

    return decorate
