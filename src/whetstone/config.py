"""Configs are pydantic models loaded from TOML, with command-line overrides of single fields.

Every config class derives from `Config`: unknown keys are errors, numbers are finite, field
docstrings become the field descriptions (used by `docs/configuration.md`), and `load_config`
turns any validation failure into a `ConfigError` that names the file, the dotted key and what
was wrong.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import tomllib
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from whetstone.errors import ConfigError
from whetstone.utils.atomic import PRIVATE, atomic_write_text, write_errors


class Config(BaseModel):
    """Base of every whetstone config section. Its numbers are finite: NaN or infinity means
    nothing in a config ("no limit" is 0 or None, as each field says), and would go on as NaN
    losses, rewards or weights, or as an OverflowError where a timeout is waited on."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _partial_sections_keep_their_defaults(cls, data: Any) -> Any:
        """A section given as a table changes only the keys it names: the rest keeps the section's
        default here (`eval = EvalConfig(samples=2)` stays at 2 samples when a TOML file sets only
        `[eval] output_dir`), not the section class's own default."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            if isinstance(field.default, Config) and isinstance(data.get(name), dict):
                merged[name] = _merge(field.default.model_dump(exclude_unset=True), data[name])
        return merged


C = TypeVar("C", bound=Config)


def _folder_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not name.strip("."):
        raise ValueError(
            "must be one folder's name: letters, digits, '_', '.' and '-', and not dots alone "
            "('.' and '..' are the output folder itself and its parent)"
        )
    return name


FolderName = Annotated[str, AfterValidator(_folder_name)]
"""A name that is one folder of its own inside an output folder (a run's name)."""


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied key by key, recursing into tables present in both."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_override(text: str, cls: type[Config] | None = None) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into its key path and a value parsed as a TOML literal.

    The key is a TOML dotted key: a quoted part is one key, dots and all (a mapping's key:
    `lr_multipliers."norm.weight"=30`). A value that is not valid TOML (`name=my-run`) is taken
    as a plain string, without the spaces around it (`output_dir = /data/runs`, as a TOML file
    writes it, is the path "/data/runs"), and so is the text of one that is not a string where
    the field of `cls` (when given) is one: `name=123` is the name "123", not a number refused
    as one. A boolean for a number field is refused: validation would take `true` as 1. TOML
    has no null: nothing after the `=` (`sync.endpoint_url=`) sets an optional field of `cls` to
    None (`key=""` is the empty string). A malformed override's error shows a real key of `cls`.
    Text that is not UTF-8 (the shell passes a Latin-1 name's bytes on as they are) is refused:
    a config is TOML, which is UTF-8, and the run's config.toml could not hold it.
    """
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ConfigError(f"override {text!r} is not UTF-8 text, which every config value is") from None
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        example = example_override(cls) if cls is not None else None
        raise ConfigError(f"override {text!r}: expected KEY=VALUE" + (f", e.g. {example}" if example else ""))
    path = _key_path(key)
    if cls is not None and not raw.strip() and _takes_none(cls, path):
        return path, None  # TOML has no null: `key=` unsets an optional field
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    kind = _field_type(cls, path) if cls is not None else None
    if kind is str and not isinstance(value, str):
        value = raw.strip()
    elif kind in (int, float) and isinstance(value, bool):
        number = "an integer" if kind is int else "a number"
        raise ConfigError(f"override {text!r}: {'.'.join(path)} takes {number}, not a boolean")
    return path, value


def _key_path(key: str) -> list[str]:
    """The parts of an override's dotted key as TOML reads one (`a."b.c"` is `a` and `b.c`); a
    key TOML does not take (`env.é`: its bare keys are ASCII) is split at every dot."""
    try:
        node: Any = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError:
        return [part.strip() for part in key.split(".")]
    path = []
    while isinstance(node, dict) and len(node) == 1:
        ((part, node),) = node.items()
        path.append(part)
    return path


def _annotation(cls: type[Config], path: list[str]) -> Any:
    """The annotation of the field at `path` in `cls` (a mapping's entries have its value type),
    or None where `path` names no field."""
    kind: Any = cls
    for part in path:
        kind = _without_none(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = kind.model_fields.get(part)
            if field is None:
                return None
            kind = field.annotation
        elif get_origin(kind) is dict:
            kind = get_args(kind)[1]
        else:
            return None
    return kind


def _field_type(cls: type[Config], path: list[str]) -> Any:
    """The type of the field at `path` in `cls` (an optional field's type without None), or None
    where `path` names no field."""
    return _without_none(_annotation(cls, path))


def _takes_none(cls: type[Config], path: list[str]) -> bool:
    """Whether the field at `path` in `cls` is optional (`X | None`)."""
    kind = _annotation(cls, path)
    return get_origin(kind) in (Union, types.UnionType) and type(None) in get_args(kind)


def _without_none(kind: Any) -> Any:
    """`X` of `X | None`; any other type as it is."""
    if get_origin(kind) in (Union, types.UnionType):
        rest = [arg for arg in get_args(kind) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return kind


def example_override(cls: type[Config]) -> str | None:
    """`key=value` of a real field of `cls` at its default, for messages: the first number
    (sections searched in order; numbers need no shell quoting), else the first plain field."""
    return _first_field(cls, None, (int, float)) or _first_field(cls, None, (bool, int, float, str))


def _first_field(cls: type[Config], instance: Config | None, kinds: tuple[type, ...]) -> str | None:
    for name, field in cls.model_fields.items():
        default = getattr(instance, name) if instance is not None else field.get_default(call_default_factory=True)
        if isinstance(default, Config):
            if (inner := _first_field(type(default), default, kinds)) is not None:
                return f"{name}.{inner}"
        elif isinstance(default, kinds) and not (isinstance(default, bool) and bool not in kinds):  # bool is an int
            return f"{name}={_toml_value(default)}"
    return None


def _set_nested(data: dict[str, Any], path: list[str], value: Any, source: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at `path`; a UTF-8 byte order mark before it (some Windows editors write
    one) is skipped. A file that cannot be read or parsed is a ConfigError naming it."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text (a TOML file is)") from None
    except OSError as err:
        raise ConfigError(f"config file {path} is not readable: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
"""`$NAME` or `${NAME}` in a path."""


def expand_path(path: str | Path) -> Path:
    """A local path as a user wrote it, with `~` (or `~user`) and environment variables (`$NAME`,
    `${NAME}`) expanded as a shell would: a TOML value or a `--set` value never passes through a
    shell. A variable that is not set, or a `~user` with no such user, is refused by name rather
    than made into a folder of that literal name. A relative path stays relative: it resolves
    against the working directory."""
    text = os.path.expanduser(os.fspath(path))
    if text.startswith("~"):
        user = text[1:].partition("/")[0]
        raise ConfigError(f"path {os.fspath(path)!r}: there is no user {user!r} to expand ~{user} for")

    def variable(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise ConfigError(f"path {os.fspath(path)!r}: the environment variable ${name} is not set")
        return os.environ[name]

    return Path(_VARIABLE.sub(variable, text))


_VALUE_ERROR_PREFIX = "Value error, "
"""What pydantic puts before the message of a `ValueError` raised by a validator."""


def format_validation_error(err: ValidationError, source: str, names: Mapping[str, str] | None = None) -> str:
    """One line per error: the dotted key, what is wrong and the value given. A check across
    fields (a validator of the whole config or of a section) shows its own message only: its
    input is the whole table, too long to repeat and not what the message is about. `names`
    renames top-level fields, for a config built from command-line options (`--dtype`)."""
    lines = [f"invalid config ({source}):"]
    for item in err.errors():
        parts = [str(part) for part in item["loc"]]
        if parts and names:
            parts[0] = names.get(parts[0], parts[0])
        key = ".".join(parts)
        message = item["msg"]
        if item["type"] == "value_error":
            message = message.removeprefix(_VALUE_ERROR_PREFIX)
            if not key or isinstance(item["input"], (dict, BaseModel)):  # across fields
                lines.append(f"  {key}: {message}" if key else f"  {message}")
                continue
        got = "" if item["type"] == "missing" else f" (got {_shown(parts, item['input'])!r})"
        lines.append(f"  {key or 'config'}: {message}{got}")
    return "\n".join(lines)


def _shown(parts: list[str], value: Any) -> Any:
    """A value given for key `parts` as an error shows it: a secret key's as `***`, a URL without
    its password (`hide_password`); config errors end up in logs."""
    if parts and SECRET_KEYS.search(parts[-1]):
        return "***"
    return hide_password(value) if isinstance(value, str) else value


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Build `cls` from an optional TOML file plus `key.sub=value` overrides (applied last)."""
    data = read_toml(path) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    for text in overrides:
        keys, value = parse_override(text, cls)
        _set_nested(data, keys, value, "override")
    if overrides:
        source += " + overrides"
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def dump_toml(config: Config) -> str:
    """Render a config as TOML: the record a run keeps of its config, and what `--dry-run` prints."""
    return _toml_table(config.model_dump(mode="json"), prefix="")


_PASSWORD = re.compile(r"^([\w+.-]+://[^:/@]*):.*?@(?=[^@/?#]*(?:[/?#]|$))", re.S)
"""A URL's `scheme://user:password@`: the password as SQLAlchemy reads it (it may hold `/`), an
unescaped `@` in it included; an `@` after the host (in the query) is not the password's."""
SECRET_KEYS = re.compile(r"(^|_)(token|password|secret)$")
"""Config keys whose values are secrets (`auth_token`)."""


def hide_password(url: str) -> str:
    """`url` with its password, if any, shown as `***` (anything else as it is)."""
    return _PASSWORD.sub(r"\1:***@", url, count=1)


def without_secrets(value: Any) -> Any:
    """A config's JSON dump with its secrets shown as `***`: the values of secret keys
    (`SECRET_KEYS`) and URLs' passwords. For what leaves the machine (W&B, TensorBoard); the
    config files a run runs again keep them (`write_toml`)."""
    if isinstance(value, dict):
        return {
            key: "***" if SECRET_KEYS.search(str(key)) and item else without_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [without_secrets(item) for item in value]
    return hide_password(value) if isinstance(value, str) else value


def write_toml(path: str | Path, config: Config) -> None:
    """Write `config` to `path` as TOML, atomically, readable by its owner only (`PRIVATE`): a
    config holds its secrets as given (a database URL's password, `auth_token`), since a run's
    config file is run again (`whetstone run <run>/config.toml`, each role's `roles/<name>.toml`).
    A write that fails (a full disk) is a WhetstoneError naming the file (`write_errors`)."""
    with write_errors(path):
        atomic_write_text(path, dump_toml(config) + "\n", PRIVATE)


def _toml_key(key: str) -> str:
    """A bare key when TOML allows one, else a quoted one (`"norm.weight"` is one key, not two)."""
    return key if key and re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


_ESCAPED = re.compile(r'["\\\x00-\x08\x0a-\x1f\x7f]')
"""What a TOML basic string cannot hold as it is: the quote, the backslash, and every control
character but the tab."""


def _escape(match: re.Match) -> str:
    char = match.group()
    return {'"': '\\"', "\\": "\\\\", "\n": "\\n"}.get(char) or f"\\u{ord(char):04X}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + _ESCAPED.sub(_escape, value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_table(data: dict[str, Any], prefix: str) -> str:
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, dict) and v is not None]
    tables = [(k, v) for k, v in data.items() if isinstance(v, dict)]
    out = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    for key, value in tables:
        name = f"{prefix}{_toml_key(key)}"
        out.append(f"\n[{name}]")
        out.append(_toml_table(value, prefix=f"{name}."))
    return "\n".join(line for line in out if line != "")


def config_reference(root: type[Config], title: str) -> str:
    """Markdown tables of every field of `root` and of its nested sections, from the docstrings.
    Defaults are the effective ones: a section's default instance overrides its class's defaults."""
    out = [f"## {title}", ""]
    try:
        instance = root()
    except ValidationError:
        instance = None  # a root with required fields: class defaults only
    _reference_section(root, prefix="", out=out, instance=instance)
    return "\n".join(out) + "\n"


def _without_metadata(annotation: Any) -> Any:
    """`annotation` with every `Annotated[T, ...]` in it as `T` (its validators are not its type)."""
    if get_origin(annotation) is Annotated:
        return _without_metadata(get_args(annotation)[0])
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is None or not args or origin is Literal:
        return annotation
    bare = tuple(_without_metadata(arg) for arg in args)
    if origin is types.UnionType:
        return functools.reduce(operator.or_, bare)
    return origin[bare] if origin is not Union else Union[bare]


def _reference_section(cls: type[Config], prefix: str, out: list[str], instance: Config | None) -> None:
    sections = []
    rows = []
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        value = getattr(instance, name) if instance is not None else None
        if isinstance(annotation, type) and issubclass(annotation, Config):
            sections.append((name, annotation, value if instance is not None else field.default))
            continue
        if field.is_required() and instance is None:
            shown = "(required)"
        else:
            default = value if instance is not None else field.get_default(call_default_factory=True)
            shown = "(none)" if default is None else f"`{_toml_value(default)}`"
        annotation = _without_metadata(annotation)  # the type, not its validators
        kind = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
        kind = kind.replace("|", "\\|")  # a bare `|` ends a table cell, even inside backticks
        description = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | `{kind}` | {shown} | {description} |")
    if rows:
        out += [f"### [{prefix.rstrip('.')}]" if prefix else "### (top level)", ""]
        out += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    for name, section, default in sections:
        _reference_section(
            section, prefix=f"{prefix}{name}.", out=out, instance=default if isinstance(default, Config) else None
        )
