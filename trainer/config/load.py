"""Loading a config: schema defaults < preset < --config file < CLI key=value, every mistake
(unknown key, wrong type, bad choice, bad YAML) a one-line UsageError naming the fix."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
from importlib import resources

from trainer.config.schema import DEFAULT_PRESET, Config, example, range_hint
from trainer.config.schema import fields as schema_fields
from trainer.errors import ConfigError, UsageError, did_you_mean, first_line, shorten


def presets() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files("trainer.conf").iterdir() if p.name.endswith(".yaml")
    )


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
    return UsageError(f"{source}: not valid YAML ({first_line(e)})")


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


def _bool_keys() -> frozenset[str]:
    """Dotted keys of the schema's bool fields (OmegaConf would take `2` for true)."""
    return frozenset(f.key for f in schema_fields() if f.type is bool)


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
        shown = _printable(item)
        if not eq or not key or key.startswith("-"):
            raise UsageError(f"override '{shown}' must look like key=value (e.g. optim.lr=0.01)")
        if _printable(key) != key:
            raise UsageError(
                f"override '{shown}': the key is not valid UTF-8: type the key in plain ASCII "
                f"(e.g. optim.lr=0.01){_suggest(_printable(key))}"
            )
        if not _KEY.match(key):
            raise UsageError(
                f"override '{shown}': '{key}' is not a dotted key like optim.lr{_suggest(key)}"
            )
        if key in _bool_keys() and value.strip().lower() not in _BOOLS:
            raise UsageError(
                f"command line: {key}: '{_printable(value)}' is not true or false "
                f"(e.g. {example(key)})"
            )
        if key in _PLUGIN_KEYS and value.rstrip().endswith(":"):  # YAML reads `a.b:` as a mapping
            raise UsageError(
                f"command line: {key}: '{_printable(value)}' names no object after the colon: "
                f"write package.module:factory (e.g. {key}=mypkg.module:build)"
            )
        if _printable(value) != value:
            raise UsageError(
                f"override '{shown}': the value of {key} is not valid UTF-8: retype it "
                f"(e.g. {example(key) if key in _leaf_keys() else key + '=...'}), or write it "
                "in a UTF-8 --config file"
            )
    items = []
    for item in overrides:
        try:
            items.append(OmegaConf.from_dotlist([item]))
        except Exception as e:
            key, _, value = item.partition("=")
            if _past_digit_limit(e):
                raise UsageError(
                    f"command line: {key}: an integer of more than 4,300 digits, which no config "
                    "key takes: fix that value"
                ) from None
            raise UsageError(
                f"command line: {key}: cannot parse '{shorten(value)}' "
                f"({first_line(e)}); quote lists like {key}=[1,2] and strings with spaces"
            ) from None
    return [(f"command line: {item}", layer) for item, layer in zip(overrides, items, strict=True)]


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
        return UsageError(f"{source}: {first_line(e)}")
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, leaf = key.rpartition(".")
        valid = _valid_keys(schema, key)
        hint = did_you_mean(leaf, valid)
        if hint and parent:
            hint = hint.replace(" '", f" '{parent}.", 1)
        hint = hint or _suggest(key)
        return UsageError(
            f"{source}: unknown key '{key}'{hint}; valid keys here: {', '.join(valid)}"
        )
    message = first_line(e)
    if "Merge error" in message or "is not a subclass" in message:
        message = f"is a section of keys, not a value: set its keys, e.g. {_section_example(key)}"
        return UsageError(f"{source}: {key}: {message}")
    hint = range_hint(key)
    if "valid bool" in message:
        hint = f" (set true or false, e.g. {example(key)})"
    if not hint and "None" in message:
        hint = f" (give it a value, e.g. {example(key)})" if key in _leaf_keys() else ""
    return UsageError(f"{source}: {key}: {message}{hint}")


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
    except ConfigError:
        raise
    except UsageError as e:
        raise ConfigError(str(e)) from None


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

    try:
        return OmegaConf.merge(merged, layer)
    except (OmegaConfBaseException, TypeError, ValueError) as e:  # TypeError: list <- dict
        raise _merge_error(e, schema, source, _culprit(schema, layer)) from None


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
