"""`trainer config explain [KEY|SECTION ...]`: each key's docstring, type, range, default and
resolved value, read from the schema itself (the docstring under each field in schema.py), so
the CLI says what the source says and cannot drift from it."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
import typing

from trainer.config import schema
from trainer.config.ranges import RANGES
from trainer.errors import UsageError, did_you_mean, shorten


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right below its annotation} for one dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class statement's body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def doc(f: schema.Field) -> str:
    """A field's docstring; a section's is its dataclass's (may be empty)."""
    if f.section:
        return inspect.cleandoc(f.type.__doc__ or "") if _has_own_doc(f.type) else ""
    parent = _section_class(f.key.rpartition(".")[0])
    return attribute_docs(parent).get(f.key.rpartition(".")[2], "")


def _has_own_doc(cls: type) -> bool:
    # a dataclass without a docstring gets a generated signature as __doc__
    return bool(cls.__doc__) and not cls.__doc__.startswith(f"{cls.__name__}(")


def _section_class(prefix: str) -> type:
    if not prefix:
        return schema.Config
    return next(f.type for f in schema.fields() if f.key == prefix)


def type_name(t: typing.Any) -> str:
    if isinstance(t, type) and not typing.get_args(t):
        return t.__name__
    return str(t).replace("typing.", "").replace("NoneType", "None")


def _shown(value: typing.Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if value == "" or value != value.strip() else value
    return str(value)


def explain(cfg: schema.Config, keys: list[str]) -> str:
    """The text for `trainer config explain KEYS` (no keys: every section, one line each)."""
    by_key = {f.key: f for f in schema.fields()}
    current = {f.key: f.value for f in schema.walk(cfg)}
    if not keys:
        lines = ["sections (trainer config explain SECTION lists its keys):"]
        for f in schema.walk(nested=False):
            summary = doc(f).split("\n\n")[0].replace("\n", " ")
            lines.append(f"  {f.key:<8} {summary}")
        return "\n".join(lines)
    out = []
    for key in keys:
        f = by_key.get(key)
        if f is None:
            raise UsageError(
                f"config explain: unknown key '{shorten(key)}'{did_you_mean(key, list(by_key))}; "
                "`trainer config explain` lists the sections"
            )
        if f.section:
            out.append(_section(f, current))
        else:
            out.append(_key(f, current[key]))
    return "\n\n".join(out)


def _key(f: schema.Field, value: typing.Any) -> str:
    default = schema.defaults()[f.key]
    head = f"{f.key}: {type_name(f.type)} = {_shown(value)}"
    if value != default:
        head += f"  (default {_shown(default)})"
    lines = [head]
    if f.key in RANGES:
        each = " (each item)" if isinstance(default, list) else ""
        lines.append(f"  range{each}: {RANGES[f.key]}")
    text = doc(f) or "(no description)"
    lines += ["  " + line for line in text.splitlines()]
    return "\n".join(lines)


def _section(f: schema.Field, current: dict) -> str:
    lines = [f"{f.key}: {doc(f)}" if doc(f) else f"{f.key}:"]
    for sub in schema.walk(f.type, f"{f.key}.", nested=False):
        value = current[sub.key]
        if sub.section:
            lines.append(f"  {sub.key:<28} (section)")
            continue
        summary = doc(sub).split("\n\n")[0].replace("\n", " ")
        shown = _shown(value)
        shown = shown if len(shown) <= 24 else shown[:21] + "..."
        lines.append(f"  {sub.key:<28} = {shown:<12} {summary}")
    return "\n".join(lines)
