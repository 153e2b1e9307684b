"""A cheaper ``__init__`` for the frozen, slotted dataclasses made on every round.

``@dataclass(frozen=True)`` writes each field in ``__init__`` with
``object.__setattr__(self, name, value)``: a slot wrapper called by name, about 1,200
instructions a field (callgrind). The events and chunks of a run are made several times
a round, so :func:`quick_init` gives such a class an ``__init__`` with the same
signature that sets each slot through its member descriptor (about half the cost). The
class stays what it was: frozen, slotted, compared and hashed by its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["quick_init"]

_Class = TypeVar("_Class", bound=type)


class _Factory:
    """The default of a field made by its default factory (shown as dataclasses does)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def quick_init(cls: _Class) -> _Class:
    """Give the frozen, slotted dataclass ``cls`` an ``__init__`` that sets its slots
    directly (same parameters, defaults and default factories as the generated one).
    Apply it above ``@dataclass``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__name__} has __post_init__ (not supported)")
    names: dict[str, Any] = {"_FACTORY": _FACTORY}
    positional: list[str] = []
    keywords: list[str] = []
    body: list[str] = []
    for field in dataclasses.fields(cls):
        setter = f"_set_{field.name}"
        names[setter] = cls.__dict__[field.name].__set__
        value = field.name
        if field.default is not dataclasses.MISSING:
            names[f"_default_{field.name}"] = field.default
            default = f"_default_{field.name}"
        elif field.default_factory is not dataclasses.MISSING:
            names[f"_factory_{field.name}"] = field.default_factory
            default = "_FACTORY"
            value = f"_factory_{field.name}() if {field.name} is _FACTORY else {field.name}"
        else:
            default = ""
        if not field.init:
            value = default if field.default_factory is dataclasses.MISSING else (
                f"_factory_{field.name}()"
            )
        else:
            parameter = field.name if not default else f"{field.name}={default}"
            (keywords if field.kw_only else positional).append(parameter)
        body.append(f"    {setter}(self, {value})")
    parameters = ", ".join(["self", *positional, *(["*", *keywords] if keywords else [])])
    source = f"def __init__({parameters}):\n" + "\n".join(body or ["    pass"]) + "\n"
    exec(source, names)  # built from the class's own field names, nothing else
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(vars(cls)["__init__"].__annotations__)
    setattr(cls, "__init__", init)  # noqa: B010 - mypy refuses a plain assignment
    return cls
