"""Name -> (typed config dataclass, builder) registries, so that a new piece is one file and one call."""

from __future__ import annotations

import dataclasses
import difflib
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

    def register(self, name: str, config_cls: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def wrap(builder: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = Entry(name, config_cls, builder)
            return builder

        return wrap

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Entry[T]:
        if name not in self._entries:
            close = difflib.get_close_matches(name, self._entries, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}.{hint}")
        return self._entries[name]

    def config(self, name: str, values: dict[str, Any] | None = None) -> Any:
        """Build the typed config of ``name`` from a plain dict, rejecting unknown keys."""
        return make_config(self.get(name).config_cls, values or {}, where=f"{self.kind} {name!r}")


def make_config(cls: type, values: dict[str, Any], where: str) -> Any:
    """Instantiate dataclass ``cls`` from ``values``; unknown keys fail with the list of known ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return cls(**values)
