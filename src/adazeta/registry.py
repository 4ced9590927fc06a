"""Name -> (typed config dataclass, builder) registries, so that a new piece is one file and one call."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Callable, Generic, TypeVar

from adazeta.errors import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    config_cls: type
    builder: Callable[..., T]


class Registry(Generic[T]):
    """A named table of builders. ``register`` is used as a decorator on the builder."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, config_cls: type | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """``@REGISTRY.register(name, Config)`` on a builder; ``config_cls`` None for a registry of objects that
        take no config (a ZO estimator: ``ESTIMATORS.register(name)(Estimator(...))``)."""
        def wrap(builder: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = Entry(name, config_cls, builder)
            return builder

        return wrap

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Entry[T]:
        if name not in self._entries:
            close = difflib.get_close_matches(name, self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}.{hint}")
        return self._entries[name]

    def config(self, name: str, values: dict[str, Any] | None = None) -> Any:
        """Build the typed config of ``name`` from a plain dict, rejecting unknown keys."""
        return make_config(self.get(name).config_cls, values or {}, where=f"{self.kind} {name!r}")


def make_config(cls: type, values: dict[str, Any], where: str, path: str | None = None) -> Any:
    """Instantiate dataclass ``cls`` from ``values``, checking keys and value types first.

    Unknown keys fail with the list of known ones; a value of the wrong type fails naming its override path
    (``path``, default: ``where`` up to its first space) and the type expected: ``method.optimizer.lr='abc' must
    be a number``. Ints are accepted where floats are expected (and converted).
    """
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of settings, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}{hint}")
    prefix = path if path is not None else where.split(" ")[0]
    hints = typing.get_type_hints(cls)
    checked = {}
    for name, value in values.items():
        checked[name] = check_type(value, hints.get(name, Any), f"{prefix}.{name}")
    return cls(**checked)


def show(value: Any) -> str:
    """A value as a user writes it in an override: null, true, 'text', 2.5."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _type_name(hint: Any) -> str:
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def check_type(value: Any, hint: Any, path: str) -> Any:
    """``value`` if it fits ``hint`` (a float for an int given as a float hint), else ConfigError naming ``path``.

    NaN and infinity are refused everywhere, inside lists and mappings too: no setting here means anything with
    them (a learning rate, a scale, a threshold), and they would only surface as a NaN loss or a crash mid-run.
    """
    ok, converted = _fits(value, hint)
    if not ok:
        raise ConfigError(f"{path}={show(value)} must be {_type_name(hint)}")
    where = non_finite(converted)
    if where is not None:
        inner, bad = where
        raise ConfigError(f"{path}{inner}={show(bad)} must be a finite number (NaN and infinity mean nothing here)")
    return converted


def non_finite(value: Any, inner: str = "") -> tuple[str, float] | None:
    """(where, value) of the first NaN or infinite float in ``value`` or inside its lists and mappings, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return inner, value
    items = enumerate(value) if isinstance(value, (list, tuple)) else value.items() if isinstance(value, dict) else ()
    for key, item in items:
        found = non_finite(item, f"{inner}[{key}]" if isinstance(key, int) else f"{inner}.{key}")
        if found is not None:
            return found
    return None


def _fits(value: Any, hint: Any) -> tuple[bool, Any]:
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True, value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            ok, converted = _fits(value, option)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        try:
            return True, float(value)
        except OverflowError:  # an integer past float's range: infinite, refused by check_type
            return True, math.inf
    if hint is str:
        return isinstance(value, str), value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(hint)
        inner = args[0] if args and (origin is list or (len(args) == 2 and args[1] is Ellipsis)) else Any
        out = []
        for item in value:
            ok, converted = _fits(item, inner)
            if not ok:
                return False, value
            out.append(converted)
        return True, type(value)(out) if origin is tuple else out
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    if dataclasses.is_dataclass(hint):
        return isinstance(value, (dict, hint)), value  # built (and checked) by the dataclass itself
    return True, value  # anything richer is the dataclass's own business


# Every registry of the project has its home here, and one registration style: ``@REGISTRY.register(name, Config)``
# on the builder, in the module that defines the piece (importing a package's modules registers its pieces).
ADAPTERS: Registry = Registry("adapter")  # adazeta.adapters: trainable sets
OPTIMIZERS: Registry = Registry("optimizer")  # adazeta.optim: ZO and first-order optimizers
ESTIMATORS: Registry = Registry("ZO estimator")  # adazeta.optim.engine: how a ZO step's losses become g_q
SCHEDULES: Registry = Registry("schedule")  # adazeta.schedules: query-count schedules
HOOKS: Registry = Registry("task render hook")  # adazeta.tasks: prompts that need code (COPA, ReCoRD, QA)
FLATTENERS: Registry = Registry("local row flattener")  # adazeta.tasks.hooks: nested local files as rows
