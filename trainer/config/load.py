"""Loading a config: schema defaults < preset < --config file < CLI key=value, every mistake
(unknown key, wrong type, bad choice, bad YAML) a one-line UsageError naming the fix."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import typing
from importlib import resources

from trainer.config.schema import DEFAULT_PRESET, Config, example, range_hint
from trainer.config.schema import fields as schema_fields
from trainer.errors import ConfigError, UsageError, did_you_mean, first_line, shorten


def presets() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files("trainer.conf").iterdir() if p.name.endswith(".yaml")
    )


MAX_ERROR_LINE = 400
"""The longest error line a load raises: what the user typed or wrote is shortened in it
(errors.shorten), as a 100,000-character key or value was echoed whole."""

_LONG_QUOTED = re.compile(r"'([^'\n]{61,})'")
_LONG_WORD = re.compile(r"\S{61,}")


def _clip(message: str, limit: int = MAX_ERROR_LINE) -> str:
    """`message`, its long quoted values and words shortened when it is over `limit` characters
    (and then cut in the middle if it still is: the key comes first and the fix last)."""
    if len(message) <= limit:
        return message
    message = _LONG_QUOTED.sub(lambda m: f"'{shorten(m.group(1))}'", message)
    message = _LONG_WORD.sub(lambda m: shorten(m.group(0)), message)
    if len(message) > limit:
        half = limit // 2 - 20
        message = (
            f"{message[:half]} ...({len(message) - 2 * half:,} characters)... {message[-half:]}"
        )
    return message


MAX_CONFIG_BYTES = 1 << 20
"""A config file larger than this is refused before it is parsed: the presets are under 1 KB, and
a 15 MB file of keys took 95 s and 1.5 GB to refuse after parsing."""


def _read_yaml(text: str, source: str):
    from omegaconf import DictConfig, OmegaConf

    try:
        kind = _yaml_kind(text)
    except (RecursionError, ValueError) as e:  # the YAML parser's own limits (depth, digits)
        raise _parse_limit(e, source, text) from None
    if kind == "empty":
        raise UsageError(
            f"{source}: the file has no config keys: put some in it (e.g. `optim: {{lr: 0.01}}`), "
            "or leave --config out"
        )
    if kind not in ("mapping", "?"):
        raise UsageError(
            f"{source}: must be a YAML mapping of config keys (like `optim: {{lr: 0.01}}`), "
            f"not a single {kind}"
        )
    try:
        node = OmegaConf.create(text)
    except (RecursionError, ValueError) as e:  # parsed, but OmegaConf's nodes recurse too
        raise _parse_limit(e, source, text) from None
    except Exception as e:  # yaml.YAMLError and OmegaConf's own grammar errors
        raise _parse_limit(e, source, text) from None
    if not isinstance(node, DictConfig):
        raise UsageError(f"{source}: must be a YAML mapping of config keys")
    return node


_ALIAS = re.compile(r"(?:^|[\s\[{,:])\*[^\s,\]}]")
"""A YAML alias (`*name`) in a value position."""


def _past_digit_limit(e: BaseException) -> bool:
    """Python refused to make an int of more than 4,300 digits (sys.get_int_max_str_digits)."""
    return "integer string conversion" in str(e)


def _parse_limit(e: BaseException, source: str, source_text: str = "") -> UsageError:
    """A one-line error for a YAML file that does not parse, or is past a parser's limits: nesting (the parsers recurse
    per level), aliases that expand past OmegaConf's node limit (a "billion laughs" file),
    integers past Python's 4,300 digits. Their own messages suggest raising the limit."""
    text = str(e)
    if isinstance(e, RecursionError):
        return UsageError(
            f"{source}: nested too deeply to be a config (the schema is 3 levels deep): "
            "write its keys as a flat mapping like `optim: {lr: 0.01}`"
        )
    if "aliases expand the document" in text or (
        "expansion exceeds" in text and _ALIAS.search(source_text)
    ):
        return UsageError(
            f"{source}: its YAML aliases (*name) expand to more values than any config holds "
            "(an alias bomb?): write the values out instead of aliasing them"
        )
    if "expansion exceeds" in text:
        return UsageError(
            f"{source}: holds more than 10,000 keys and values; a config holds about 100: is it "
            "the right file?"
        )
    if "recursive aliases" in text:
        return UsageError(
            f"{source}: a YAML alias (*name) refers to the mapping or list it is in, which never "
            "ends: write the values out"
        )
    if _past_digit_limit(e):
        return UsageError(
            f"{source}: holds an integer of more than 4,300 digits, which no config key takes: "
            "fix that value"
        )
    located = _yaml_error(e, source_text, source)
    if located:
        where, what = located
        return UsageError(f"{where}: not valid YAML: {what}")
    return UsageError(f"{source}: not valid YAML ({_clip(first_line(e))})")


def _yaml_error(e: BaseException, text: str, source: str = "") -> tuple[str, str] | None:
    """(where, '<the parser's problem>: <the fix>') for a YAML syntax error (PyYAML's
    MarkedYAMLError, or its reader's refusal of a character), else None. Positions are 1-based:
    'my.yaml:3:5' in a file (`source`), 'character 5' in a command-line value (no `source`)."""
    import yaml

    def at(line: int, column: int) -> str:
        if source:
            return f"{line + 1}:{column + 1}"
        if "\n" not in text and (line or column >= len(text)):  # PyYAML's mark for the end
            return "the end"
        return f"character {column + 1}" + (f" of line {line + 1}" if line else "")

    where = (lambda line, column: f"{source}:{at(line, column)}") if source else at
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.position, int):
        index = _reader_index(e, text)
        line = text.count("\n", 0, index)
        column = index - text.rfind("\n", 0, index) - 1
        return where(line, column), f"{first_line(e)}: delete that character"
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return None
    mark = e.problem_mark
    problem, fix = _yaml_fix(e, text, at)
    return where(mark.line, mark.column), f"{problem}: {fix}"


def _reader_index(e, text: str) -> int:
    """The index in `text` of the character a YAML reader refused: libyaml (OmegaConf's loader)
    gives the offset of its byte in UTF-8, PyYAML's own reader that of the character."""
    refused = e.character
    if isinstance(refused, str) and len(refused) == 1:
        refused = ord(refused)
    if e.position < len(text) and ord(text[e.position]) == refused:
        return e.position
    return len(text.encode("utf-8")[: e.position].decode("utf-8", "ignore"))


def _char(text: str, mark) -> str:
    """The character at a YAML mark ('' past the end of its line or the text)."""
    lines = text.split("\n")
    line = lines[mark.line].rstrip("\r") if mark.line < len(lines) else ""
    return line[mark.column] if mark.column < len(line) else ""


def _yaml_fix(e, text: str, at) -> tuple[str, str]:
    """(the parser's problem, the fix) for a YAML syntax error, the fix where it is
    recognisable (a duplicate key, an unclosed bracket or quote, a tab, an indent)."""
    problem, context = e.problem or "", e.context or ""
    mark, opened = e.problem_mark, e.context_mark
    here = _char(text, mark)
    start = at(opened.line, opened.column) if opened is not None else ""
    if problem.startswith("found duplicate key "):
        key = problem.removeprefix("found duplicate key ")
        return f"found duplicate key '{shorten(key)}'", _duplicate_fix(e, key, text, at)
    if problem.startswith("did not find expected ',' or ") and start:
        bracket, close = ("{", "}") if "mapping" in context else ("[", "]")
        if here in ("]", "}"):
            return problem, f"close the '{bracket}' at {start} with '{close}' before that '{here}'"
        if mark.line == opened.line and here:
            return problem, f"put a ',' between the items of the '{bracket}' at {start}"
        return problem, f"close the '{bracket}' at {start} with '{close}'"
    if "cannot start any token" in problem:
        if here == "\t":
            return f"{problem} (a tab)", "indent with spaces: YAML takes no tabs there"
        return f"{problem} ({here!r})", f"quote the value (YAML keeps {here!r} for itself)"
    if problem.startswith("mapping values are not allowed") and (bare := _bare_line(text, mark)):
        return problem, f"line {bare[0]} ('{shorten(bare[1])}') has no ':': write key: value"
    if problem.startswith("mapping values are not allowed"):
        return problem, (
            "quote a value that holds ': ' (e.g. \"a: b\"), and start each key on a line of "
            "its own, indented like the keys beside it"
        )
    if problem == "did not find expected node content" and here == ",":
        return problem, "remove that ',': an item is missing before it"
    if problem == "did not find expected node content" and (bracket := _unclosed(text)):
        close = "]" if bracket[0] == "[" else "}"
        return problem, f"close the '{bracket[0]}' at {at(*bracket[1:])} with '{close}'"
    if problem == "did not find expected key" and here in ("}", "]"):
        return problem, f"remove that '{here}': it closes nothing"
    if problem == "did not find expected key" and here == "-":
        return problem, "a list item among keys: give it a key, or indent it under its key"
    if problem == "did not find expected key" or problem.startswith("expected <block end>"):
        return problem, (
            "indent the key there by as many spaces as the keys beside it (the keys of one "
            "section line up)"
        )
    if problem == "could not find expected ':'" and start:
        return problem, f"give the key at {start} a ':' and a value (key: value)"
    if problem == "found unexpected end of stream" and "quoted scalar" in context and start:
        return problem, f"close the quote opened at {start}"
    return problem, _yaml_fix_more(problem, context, start)


def _yaml_fix_more(problem: str, context: str, start: str) -> str:
    """The fix for the rarer YAML problems (the parser's text alone for the rest)."""
    if problem == "but found another document":
        return "remove that '---': a config is one YAML document"
    if "scanning an alias" in context or "scanning an anchor" in context:
        return "quote a value that starts with '*' or '&' (YAML's alias and anchor), e.g. '*.bias'"
    if problem == "found undefined alias":
        return "define the anchor (&name) before its alias (*name), or quote a value starting '*'"
    if problem == "second occurrence":
        return f"rename one of the two anchors (the first is at {start})"
    if "for merging" in problem:
        return "a '<<:' key merges a mapping: give it one (<<: *name)"
    if problem == "found unhashable key":
        return "write that key as a plain name: a list or mapping cannot be a key"
    if "constructor for the tag" in problem:
        return "remove the tag (!...): a config holds plain values"
    if "unknown escape character" in problem:
        return "double the backslash (\\\\), or use single quotes"
    if "expected '-' indicator" in problem:
        return "start every item of the list with '- ', at the same indent (no 'key:' lines)"
    if "directive" in problem or "directive" in context:
        return "quote a value that starts with '%'"
    return "fix the YAML there"


def _unclosed(text: str) -> tuple[str, int, int] | None:
    """The innermost '[' or '{' that `text` leaves open, and its 0-based line and column
    (quoted text and comments skipped, roughly: the hint's, not the parser's)."""
    stack: list[tuple[str, int, int]] = []
    quote = ""
    for number, line in enumerate(text.split("\n")):
        for column, char in enumerate(line):
            before = line[column - 1] if column else " "
            if quote:
                quote = "" if char == quote else quote
            elif char in "'\"" and before in " \t[{,:":
                quote = char
            elif char == "#" and before in " \t":
                break
            elif char in "[{":
                stack.append((char, number, column))
            elif char in "]}" and stack:
                stack.pop()
    return stack[-1] if stack else None


def _bare_line(text: str, mark) -> tuple[int, str] | None:
    """(1-based number, text) of the line above `mark`'s when it is a key without a ':' (the
    parser stumbles on the next line's ':'), else None."""
    lines = text.split("\n")[: mark.line]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or ":" in lines[-1] or lines[-1].lstrip().startswith(("-", "#")):
        return None
    return len(lines), lines[-1].strip()


def _duplicate_fix(e, key: str, text: str, at) -> str:
    """'remove one of the two 'lr:' lines (2 and 5)' for a mapping that has a key twice."""
    import yaml

    shown, mapping = shorten(key), e.context_mark
    lines = []
    with contextlib.suppress(Exception):  # the positions are a nicety: the fix stands without
        stack = [yaml.compose(text, Loader=yaml.SafeLoader)]
        while stack and not lines:
            node = stack.pop()
            if isinstance(node, yaml.MappingNode) and (
                node.start_mark.line,
                node.start_mark.column,
            ) == (mapping.line, mapping.column):
                lines = [k.start_mark for k, _ in node.value if k.value == key]
            elif isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
                for child in node.value:  # (key, value) pairs, or a list's items
                    stack.extend(child if isinstance(child, tuple) else [child])
    if len({m.line for m in lines}) >= 2:
        where = " and ".join(str(m.line + 1) for m in lines[:2])
        return f"remove one of the two '{shown}:' lines ({where})"
    if len(lines) >= 2:
        where = " and ".join(at(m.line, m.column) for m in lines[:2])
        return f"remove one of the two '{shown}:' entries (at {where})"
    return f"remove one of the two '{shown}:' entries"


def _yaml_kind(text: str) -> str:
    """mapping | list | string | number | boolean | empty, or ? when it does not parse."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return "?"
    except ValueError as e:  # past a limit of the parser's (a huge integer): the caller says
        if _past_digit_limit(e):
            raise
        return "?"
    if value is None:
        return "empty"
    kinds = {dict: "mapping", list: "list", str: "string", int: "number", float: "number"}
    return "boolean" if isinstance(value, bool) else kinds.get(type(value), "?")


def _read_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        size = os.path.getsize(path)
        raise UsageError(
            f"--config {path}: is {size / 2**20:,.1f} MB; a config is a few KB (at most "
            f"{MAX_CONFIG_BYTES // 2**20} MB here): is it the right file?"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        binary = b"\0" in raw
        raise UsageError(
            f"--config {path}: "
            + (
                "is a binary file, not YAML: give a YAML file, a preset name or a run directory"
                if binary
                else f"is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): save it "
                "as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            )
        ) from None


@functools.cache
def _preset_layer(name: str):
    """A packaged preset's parsed YAML (parsed once per process: merges never change a layer)."""
    text = resources.files("trainer.conf").joinpath(f"{name}.yaml").read_text()
    return _read_yaml(text, f"preset '{name}'")


def _layer_for(config: str | None, seen: tuple[str, ...] = ()):
    """(source, DictConfig) layers for --config: a preset name or a YAML file path."""
    if config is None:
        config = DEFAULT_PRESET
    names = presets()
    if config in names:
        return [(f"preset '{config}'", _preset_layer(config))]
    if os.path.isdir(config):
        if not os.path.isfile(os.path.join(config, "config.yaml")):
            raise UsageError(
                f"--config: '{config}' is a directory without config.yaml (not a run "
                "directory): give a run directory, a YAML file or a preset name"
            )
        config = os.path.join(config, "config.yaml")  # a run directory: re-run it
        run_dir_config = True
    else:
        run_dir_config = False
    if not os.path.isfile(config):
        raise UsageError(
            f"--config: '{config}' is neither a preset{did_you_mean(config, names)} nor a YAML file; "
            f"presets: {', '.join(names)}"
        )
    if os.path.realpath(config) in seen:
        raise UsageError(f"{config}: `preset:` includes itself (a cycle): remove that line")
    node = _read_yaml(_read_file(config), config)
    if run_dir_config:  # its own folder is where it ran: a re-run gets a new one (or run_dir=)
        node.pop("run_dir", None)
    layers = []
    base = node.pop("preset", None)  # a user file may build on a preset: `preset: digits-lenet`
    if base is not None:
        if not isinstance(base, str) or not base:
            raise UsageError(
                f"{config}: preset: needs a preset name or a YAML path (e.g. preset: digits-lenet)"
                f", got {base}"
            )
        layers += _layer_for(base, (*seen, os.path.realpath(config)))
    return [*layers, (config, node)]


_BOOLS = ("true", "false", "yes", "no", "on", "off", "1", "0")
_PLUGIN_KEYS = ("data.name", "model.name", "task.name")
"""Keys that take a registry name or package.module:object."""


def _bool_keys() -> dict[str, tuple[str, ...]]:
    """Dotted keys of the schema's bool fields (OmegaConf would take `2` for true) and the
    words each takes: null too where it is optional (optim.fused)."""
    words = {bool: _BOOLS, bool | None: (*_BOOLS, "null", "~")}
    return {f.key: words[f.type] for f in schema_fields() if f.type in words}


def _is_bool_word(value: str, words: tuple[str, ...]) -> bool:
    """true/false/yes/no/on/off/1/0 in any case, as YAML reads them; null and ~ as written."""
    value = value.strip()
    return value.lower() in _BOOLS or (value in words and value in ("null", "~"))


_KEY = re.compile(r"^[A-Za-z_][\w-]*(\[\d+\])?(\.[A-Za-z_][\w-]*(\[\d+\])?)*$")


def _leaf_keys() -> list[str]:
    """Every dotted key of the schema (nested sections too)."""
    return [f.key for f in schema_fields()]


def _suggest(key: str) -> str:
    """' (did you mean 'optim.lr'?)' for a misspelt or misplaced dotted key, else ''."""
    keys = _leaf_keys()
    cleaned = ".".join(p for p in key.replace(" ", "").split(".") if p)
    if cleaned in keys and cleaned != key:
        return f" (did you mean '{cleaned}'?)"
    leaf = cleaned.rpartition(".")[2]
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_leaf and cleaned not in keys:
        return f" (did you mean '{same_leaf[0]}'?)"
    return did_you_mean(cleaned, keys)


def _printable(text: str) -> str:
    """The text with undecodable bytes (from a non-UTF-8 argv) shown as \\xNN escapes."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _cli_layer(overrides: list[str]):
    from omegaconf import OmegaConf

    for item in overrides:
        key, eq, value = item.partition("=")
        shown, key_shown = shorten(_printable(item)), shorten(_printable(key))
        if not eq or not key or key.startswith("-"):
            raise UsageError(f"override '{shown}' must look like key=value (e.g. optim.lr=0.01)")
        if _printable(key) != key:
            raise UsageError(
                f"override '{shown}': the key is not valid UTF-8: type the key in plain ASCII "
                f"(e.g. optim.lr=0.01){_suggest(_printable(key))}"
            )
        if not _KEY.match(key):
            raise UsageError(
                f"override '{shown}': '{key_shown}' is not a dotted key like optim.lr"
                f"{_suggest(key)}"
            )
        words = _bool_keys().get(key)
        if words is not None and not _is_bool_word(value, words):
            also = " or null" if "null" in words else ""
            raise UsageError(
                f"command line: {key_shown}: '{shorten(_printable(value))}' is not true or "
                f"false{also} (e.g. {example(key)})"
            )
        if key in _PLUGIN_KEYS and value.rstrip().endswith(":"):  # YAML reads `a.b:` as a mapping
            raise UsageError(
                f"command line: {key}: '{shorten(_printable(value))}' names no object after the "
                f"colon: write package.module:factory (e.g. {key}=mypkg.module:build)"
            )
        if _printable(value) != value:
            raise UsageError(
                f"override '{shown}': the value of {key_shown} is not valid UTF-8: retype it "
                f"(e.g. {example(key) if key in _leaf_keys() else key + '=...'}), or write it "
                "in a UTF-8 --config file"
            )
    items = []
    for item in overrides:
        try:
            items.append(OmegaConf.from_dotlist([item]))
        except Exception as e:
            raise _override_error(e, item) from None
        key, _, value = item.partition("=")
        if value.lstrip().startswith("&") and _text_key(key):
            if OmegaConf.select(items[-1], key) is not None:
                continue
            # `&x` alone: an anchor on nothing, null (a pattern or name starting with '&')
            fix = _alias_fix(None, key, value)
            raise UsageError(f"command line: {shorten(key)}: '{shorten(value)}' is null: {fix}")
    return [(f"command line: {item}", layer) for item, layer in zip(overrides, items, strict=True)]


def _override_error(e: BaseException, item: str) -> UsageError:
    """One line for an override whose value does not parse (OmegaConf reads it as YAML): where
    in the value, the parser's problem and the fix, or the limit it is past."""
    key, _, value = item.partition("=")
    head = f"command line: {shorten(key)}"
    if _past_digit_limit(e):
        return UsageError(
            f"{head}: an integer of more than 4,300 digits, which no config key takes: fix that "
            "value"
        )
    if "expansion exceeds" in str(e) or "aliases expand the document" in str(e):
        return _override_limit(str(e), key, value)
    if "recursive aliases" in str(e):
        return UsageError(
            f"{head}: a YAML alias (*name) refers to the list or mapping it is in, which never "
            "ends: write the values out"
        )
    if quoted := _alias_fix(e, key, value):
        return UsageError(f"{head}: cannot parse '{_escaped(shorten(value))}': {quoted}")
    located = _yaml_error(e, value)
    if located is None:
        return UsageError(
            f"{head}: cannot parse '{shorten(value)}' ({_clip(first_line(e), 200)}); quote "
            f"lists like {shorten(key)}=[1,2] and strings with spaces"
        )
    where, what = located
    split = where == "the end" and ("end of stream" in what or "expected" in what)
    return UsageError(
        f"{head}: cannot parse '{_escaped(shorten(value))}' at {where}: {what}"
        + ("; the shell splits an override at a space unless it is quoted" if split else "")
    )


def _text_key(key: str) -> bool:
    """Whether `key` is a text field of the schema (str, or str | None)."""
    t = {f.key: f.type for f in schema_fields()}.get(key)
    return t is str or str in typing.get_args(t)


def _alias_fix(e: BaseException, key: str, value: str) -> str | None:
    """The fix for a value YAML took for an alias (`*.bias`, a glob) or an anchor (`&x`): quote
    it, YAML's quotes inside the shell's."""
    context, problem = getattr(e, "context", None) or "", getattr(e, "problem", None) or ""
    if "scanning an alias" in context or problem == "found undefined alias":
        what = "'*' as an alias (*name)"
    elif "scanning an anchor" in context or e is None:
        what = "'&' as an anchor (&name)"
    else:
        return None
    sample = shorten(value.strip().strip("[]") or "*.bias", 40).replace("'", "")
    return (
        f"YAML reads a leading {what}: quote the value, YAML's quotes inside the shell's, "
        f"e.g. \"{shorten(key, 40)}='{sample}'\""
    )


def _escaped(text: str) -> str:
    """`text` with control characters (a terminal's bell, escapes) shown as \\xNN."""
    return "".join(c if c.isprintable() or c == " " else f"\\x{ord(c):02x}" for c in text)


def _override_limit(message: str, key: str, value: str) -> UsageError:
    """An override past OmegaConf's limit on the values one YAML text may hold (its guard
    against alias bombs): the limit, and what to do."""
    found = re.search(r"limit of (\d+)", message)
    limit = int(found.group(1)) if found else 10_000
    head = f"command line: {shorten(key)}"
    if "aliases expand" in message or _ALIAS.search(value):
        return UsageError(
            f"{head}: its YAML aliases (*name) expand to more values than any config holds "
            "(an alias bomb?): write the values out instead of aliasing them"
        )
    flat = value.strip().startswith("[") and value.count("[") == 1
    size = f"a list of {value.count(',') + 1:,} items" if flat else "a value"
    if key in _leaf_keys():
        fix = f"{key} takes a few (e.g. {example(key)}): give the ones it needs"
    else:
        fix = "put that many values in a file and pass its path instead"
    return UsageError(
        f"{head}: {size}, past the {limit:,} values one override may hold (OmegaConf's guard "
        f"against YAML alias bombs): {fix}"
    )


def _valid_keys(schema, full_key: str) -> list[str]:
    parent = full_key.rpartition(".")[0]
    from omegaconf import OmegaConf

    node = OmegaConf.select(schema, parent) if parent else schema
    return list(node.keys()) if node is not None and hasattr(node, "keys") else []


def _first_key(layer) -> str | None:
    """The full dotted key of the (first) leaf in a layer: the key a one-override layer sets."""
    from omegaconf import DictConfig

    key, node = "", layer
    while isinstance(node, DictConfig) and len(node) >= 1:
        name = next(iter(node.keys()))
        key = f"{key}.{name}" if key else str(name)
        node = node._get_node(name)
        if len(getattr(node, "keys", lambda: [None, None])()) != 1:
            break
    return key or None


def _merge_error(e: Exception, schema, source: str, layer=None) -> UsageError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(e, "full_key", None) or (_first_key(layer) if layer is not None else None)
    source = "command line" if source.startswith("command line: ") else source
    if not key:
        return UsageError(f"{source}: {_clip(first_line(e), 200)}")
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        valid = _valid_keys(schema, key)
        hint = did_you_mean(leaf, valid)
        if hint and parent:
            hint = hint.replace(" '", f" '{parent}.", 1)
        hint = hint or _suggest(key)
        return UsageError(
            f"{source}: unknown key '{shorten(key)}'{hint}; valid keys here: {', '.join(valid)}"
        )
    message = _clip(first_line(e), 200)
    if "Merge error" in message or "is not a subclass" in message:
        message = f"is a section of keys, not a value: set its keys, e.g. {_section_example(key)}"
        return UsageError(f"{source}: {shorten(key)}: {message}")
    if shape := _shape_problem(key, message, layer):
        return UsageError(f"{source}: {shorten(key)}: {shape}")
    hint = range_hint(key)
    if "valid bool" in message:
        hint = f" (set true or false, e.g. {example(key)})"
    if not hint and "None" in message:
        hint = f" (give it a value, e.g. {example(key)})" if key in _leaf_keys() else ""
    return UsageError(f"{source}: {shorten(key)}: {message}{hint}")


_MAPPINGS = {
    "ckpt.init_rename": "a mapping {REGEX: REPLACEMENT}",
    "optim.groups": "named groups, optim.groups.NAME={params: [GLOB, ...], lr_mult: N}",
}
_GLOBS = ("optim.freeze", "optim.lora_targets", "optim.lora_also_train", "ckpt.init_exclude")
"""The keys of comma-separated glob patterns (one string)."""


def _shape_problem(key: str, message: str, layer) -> str | None:
    """What is wrong, and the fix, where a value has the wrong shape for its key: a mapping's
    key given text, a number or a list (OmegaConf: "Cannot assign/merge ..."), a text key given
    a list or mapping ("Cannot convert ..."), or null where a key takes none."""
    types = {f.key: f.type for f in schema_fields()}
    parent = key.rpartition(".")[0]
    if typing.get_origin(types.get(key)) is dict and (
        "Cannot assign" in message or "incompatible container" in message
    ):
        what = _MAPPINGS.get(key, "a mapping of keys")
        return f"takes {what}, not {_given(layer, key)}: write e.g. {example(key)}"
    if typing.get_origin(types.get(parent)) is dict and "is not Optional" in message:
        what = "a replacement string" if parent == "ckpt.init_rename" else "a value"
        return f"needs {what}, not null: e.g. {example(parent)}"
    if types.get(key) is str and "Cannot convert" in message:
        given = "a list" if "ListConfig" in message else "a mapping"
        what = "comma-separated glob patterns in one string" if key in _GLOBS else "text"
        return f"takes {what}, not {given}: e.g. {example(key)}"
    if types.get(key) is str and "None" in message:
        fix = f", or leave {key} out (none)" if key in _GLOBS else ""
        return (
            f"an empty value reads as null, which it does not take: give it a value, e.g. "
            f"{example(key)}{fix}"
        )
    return None


def _given(layer, key: str) -> str:
    """The value `layer` sets `key` to, for a message ('text 'abc'', 'the number 5', 'a list')."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = OmegaConf.select(layer, key, default=None) if layer is not None else None
    if isinstance(node, ListConfig):
        return "a list"
    if isinstance(node, DictConfig) or node is None:
        return "that value"
    if isinstance(node, str):
        return f"the text '{shorten(node)}'"
    kind = "boolean" if isinstance(node, bool) else "number"
    return f"the {kind} {shorten(repr(node))}"


def _section_example(key: str) -> str:
    first = next((f.key for f in schema_fields() if f.key.rpartition(".")[0] == key), None)
    return example(first) if first else f"{key}.<key>=<value>"


def load(
    config: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    values: dict | None = None,
    source: str = "values",
) -> Config:
    """Merge schema < preset < --config file < `values` (a nested dict, e.g. trainer.fit's) <
    CLI overrides into a validated Config."""
    try:
        return _load(config, overrides, values, source)
    except UsageError as e:  # a ConfigError too: its line may echo what the user typed
        message = _clip(str(e))
        if isinstance(e, ConfigError) and message == str(e):
            raise
        raise ConfigError(message) from None


def _load(config, overrides, values=None, values_source="values") -> Config:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = _schema()
    shared = None  # a packaged preset's cached merge: never changed, merges below copy it
    if config is None or config in presets():
        merged = shared = _preset_merged(config or DEFAULT_PRESET)
    else:
        merged = schema
        for source, layer in _layer_for(config):
            merged = _merge(schema, merged, source, layer)
    if values:
        try:
            layer = OmegaConf.create(values)
        except (OmegaConfBaseException, ValueError, TypeError) as e:
            raise UsageError(f"{values_source}: not a config mapping ({first_line(e)})") from None
        merged = _merge(schema, merged, values_source, layer)
    cli = _cli_layer(list(overrides))
    # Several overrides in one merge (each merge copies the whole config: ~10 ms an override);
    # if it fails, merged is untouched and they go one at a time below, to name the culprit.
    with contextlib.suppress(OmegaConfBaseException, TypeError, ValueError):
        if len(cli) > 1:
            merged, cli = OmegaConf.merge(merged, *(layer for _, layer in cli)), []
    for source, layer in cli:
        merged = _merge(schema, merged, source, layer)
    if merged is shared:  # nothing merged over it: a copy
        merged = copy.deepcopy(merged)
    try:
        OmegaConf.resolve(merged)
        cfg = OmegaConf.to_object(merged)
    except UsageError:
        raise
    except OmegaConfBaseException as e:
        raise _merge_error(e, schema, "config") from None
    return cfg


def _merge(schema, merged, source: str, layer):
    """`layer` merged over `merged`; a failure is one line naming `source` and the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not source.startswith("command line"):  # the command line's are checked as text
        _check_bools(source, layer)
    try:
        return OmegaConf.merge(merged, layer)
    except (OmegaConfBaseException, TypeError, ValueError) as e:  # TypeError: list <- dict
        raise _merge_error(e, schema, source, _culprit(schema, layer)) from None


_ABSENT = object()


def _check_bools(source: str, layer) -> None:
    """A config file's (or trainer.fit's values') bool keys: true or false (1 or 0, as the
    command line takes), or null where the key is optional. OmegaConf would take `2` or the
    string "yes" for true."""
    from omegaconf import OmegaConf

    for key, words in _bool_keys().items():
        try:
            value = OmegaConf.select(layer, key, default=_ABSENT)
        except Exception:  # an interpolation resolved later, or a section where a key is
            continue  # the merge names those
        ok = value is _ABSENT or isinstance(value, bool) or value in (0, 1)
        if ok or (value is None and "null" in words):
            continue
        also = " or null" if "null" in words else ""
        raise UsageError(
            f"{source}: {key}: {shorten(_printable(repr(value)))} is not true or false{also} "
            f"(e.g. {example(key)})"
        )


@functools.cache
def _preset_merged(name: str):
    """The schema with a packaged preset merged over it, once per process (a merge copies the
    whole config: ~10 ms of every load); never changed: what is merged over it is a copy."""
    merged = _schema()
    for source, layer in _layer_for(name):
        merged = _merge(_schema(), merged, source, layer)
    return merged


@functools.lru_cache(maxsize=1)
def _schema():
    """The structured schema (built once: merges copy it, never change it)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(Config)


def _culprit(schema, layer):
    """The top-level section of `layer` whose merge fails (a layer of that key alone)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for name in list(layer.keys()):
        part = OmegaConf.create({name: layer._get_node(name)})
        try:
            OmegaConf.merge(schema, part)
        except (OmegaConfBaseException, TypeError, ValueError):
            return part
    return layer


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))
