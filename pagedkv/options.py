"""Options declared once, as fields of a config dataclass (vLLM's `EngineArgs` idea).

A field made with `option(...)` carries its default, its help text, how the CLI spells and
parses it, and its choices; the config's `__post_init__` validates the values. Everything else
is generated from the fields:

- `add_arguments(parser, Config)`: the argparse arguments (`--block-size` from `block_size`;
  a bool defaulting to False is a `--flag`, one defaulting to True needs `flag="--no-..."`);
- `from_namespace(Config, args)`: the config from parsed arguments;
- `build(Config, base, options)`: the config from keyword options (`LLM(block_size=32)`), an
  unknown name raising UnknownOptionError;
- `cli_spelling(exc)`: a validation error re-spelled with flags instead of field names.

So a new option is one field: `kv_tier_key: str | None = option(None, "help text")`, plus its
check in `__post_init__` if it has one. Invariants: every CLI default is the field's default;
a config that exists has passed validation (configs are frozen; `dataclasses.replace`
validates again). Validation errors name fields by their Python names and list them in the
exception's `options` attribute (`invalid`), which is what `cli_spelling` rewrites.

Nothing here imports torch: `pagedkv serve --help` builds its parser from the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pagedkv.errors import PagedKVError, UnknownOptionError

C = TypeVar("C")
_DERIVED = "derived"  # flag=_DERIVED: spelled from the field name


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """How one config field appears on the command line (flag None: Python only)."""

    help: str | None
    flag: str | None
    parse: Callable[[str], Any] | None
    choices: tuple[Any, ...] | None
    metavar: str | None
    action: str | None
    nargs: str | None = None


def option(default: Any, help: str | None = None, *, flag: str | None = _DERIVED,  # noqa: A002
           parse: Callable[[str], Any] | None = None, choices: tuple[Any, ...] | None = None,
           metavar: str | None = None, action: str | None = None, repr: bool = True,  # noqa: A002
           nargs: str | None = None) -> Any:
    """A dataclass field with its CLI declaration. flag=None keeps it off the command line;
    repr=False keeps a secret out of the config's repr; nargs="+": a list of `parse`d values."""
    meta = Option(help, flag, parse, choices, metavar, action, nargs)
    return dataclasses.field(default=default, metadata={"option": meta}, repr=repr)


def flag_of(f: dataclasses.Field) -> str | None:
    opt = f.metadata.get("option")
    if opt is None or opt.flag is None:
        return None
    return "--" + f.name.replace("_", "-") if opt.flag == _DERIVED else opt.flag


def cli_fields(cls: type) -> list[tuple[dataclasses.Field, str]]:
    """(field, flag) for every field of `cls` the command line takes, in declaration order."""
    return [(f, flag) for f in dataclasses.fields(cls) if (flag := flag_of(f)) is not None]


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argparse argument per CLI field of `cls`, dest = the field name."""
    for f, flag in cli_fields(cls):
        opt: Option = f.metadata["option"]
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": opt.help}
        if isinstance(f.default, bool):
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw.update({k: v for k, v in (("type", opt.parse), ("metavar", opt.metavar),
                                         ("action", opt.action), ("nargs", opt.nargs))
                       if v is not None})
            if opt.choices is not None:
                kw["choices"] = list(opt.choices)
        parser.add_argument(flag, **kw)


def from_namespace(cls: type[C], args: argparse.Namespace) -> C:
    """The config that parsed arguments describe (fields the namespace lacks keep defaults)."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def build(cls: type[C], base: C | None, options: Mapping[str, Any]) -> C:
    """`base` (or the defaults) with `options` applied; UnknownOptionError names a stranger."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    for name in options:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownOptionError(f"unknown option {name!r} for {cls.__name__}{hint}")
    if base is None:
        return cls(**options)
    if not isinstance(base, cls):
        raise UnknownOptionError(f"config must be a {cls.__name__}, got {type(base).__name__}")
    return dataclasses.replace(base, **options)  # type: ignore[type-var]


# --- validation helpers ------------------------------------------------------------------------


def invalid(exc_type: type[PagedKVError], message: str, *names: str) -> PagedKVError:
    """The typed error for a bad value; `names` are the fields the message names."""
    exc = exc_type(message)
    exc.options = names  # type: ignore[attr-defined]
    return exc


def cli_spelling(exc: BaseException, *classes: type) -> None:
    """Rewrite, in place, the field names an `invalid` error lists as `classes`' flags (the
    first mention of each: "port 0 is not a TCP port" -> "--port 0 is not a TCP port")."""
    names = getattr(exc, "options", ())
    if not names or not exc.args:
        return
    flags = {f.name: flag for cls in classes for f, flag in cli_fields(cls)}
    msg = str(exc.args[0])
    for name in sorted(names, key=len, reverse=True):
        if name in flags:
            msg = re.sub(rf"(?<![\w-]){re.escape(name)}(?!\w)", flags[name], msg, count=1)
    exc.args = (msg, *exc.args[1:])


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_positive(cfg: object, exc_type: type[PagedKVError], *names: str,
                   optional: bool = False) -> None:
    """Each named field is an int >= 1 (or None when `optional`)."""
    for name in names:
        v = getattr(cfg, name)
        if not (is_int(v) and v >= 1) and not (optional and v is None):
            what = "a positive int or None" if optional else "a positive int"
            raise invalid(exc_type, f"{name} must be {what}, got {v!r}", name)


def check_seconds(cfg: object, exc_type: type[PagedKVError], *names: str,
                  zero: bool = False) -> None:
    """Each named field is a finite number of seconds > 0 (>= 0 when `zero`)."""
    for name in names:
        v = getattr(cfg, name)
        ok = (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
              and (v >= 0 if zero else v > 0))
        if not ok:
            bound = ">= 0" if zero else "> 0"
            raise invalid(exc_type, f"{name} must be a finite number of seconds {bound}, "
                                    f"got {v!r}", name)


# --- argument types: a bad value is a one-line usage error, before anything loads -----------


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v
