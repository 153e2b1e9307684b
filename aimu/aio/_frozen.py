"""A cheaper constructor for the frozen, slotted dataclasses made on every round.

``@dataclass(frozen=True)`` writes each field in ``__init__`` with
``object.__setattr__(self, name, value)``: a slot wrapper called by name, about 1,200
instructions a field (callgrind), because the class's own ``__setattr__`` refuses every
write. The events and chunks of a run are made several times a round (and a chunk per
streamed piece of a reply), so :func:`quick_init` builds such an object the way a plain
slotted class is built: as an instance of a *twin* class with the same slots and no
``__setattr__`` of its own, whose fields are plain attribute writes, and then gives it
its class with one ``__class__`` assignment (CPython allows it between classes of the
same layout). A 4-field event costs about 2,500 instructions to make instead of 4,800
(one slot-wrapper call a field) or 7,100 (the generated ``__init__``).

The class stays what ``@dataclass`` made: frozen (no write after construction),
slotted, compared, hashed, copied and pickled by its fields, the same signature. Its
``__init__`` is ``object``'s (``__new__`` does the work). A subclass (its own layout) is
made as ``@dataclass`` would: by its own ``__init__``, or without one, its fields set
one by one as the base's are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["quick_init"]

_Class = TypeVar("_Class", bound=type)



class _Factory:
    """The default of a field made by its default factory (shown as dataclasses does)."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def quick_init(cls: _Class) -> _Class:
    """Give the frozen, slotted dataclass ``cls`` a ``__new__`` that builds it through a
    twin of its layout (same parameters, defaults and default factories as the
    generated ``__init__``, which it replaces). Apply it above ``@dataclass``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__name__} has __post_init__ (not supported)")
    if cls.__bases__ != (object,):
        raise TypeError(f"quick_init: {cls.__name__} has a base class (not supported)")
    fields = list(dataclasses.fields(cls))
    for field in fields:  # the generated code's own names: "self", and "_" first
        if field.name == "self" or field.name.startswith("_"):
            raise TypeError(f"quick_init: {cls.__name__} has a field named {field.name!r}")
    twin = type(f"_{cls.__name__}Twin", (), {"__slots__": vars(cls)["__slots__"]})
    names: dict[str, Any] = {"_FACTORY": _FACTORY, "_owner": cls, "_twin": twin}
    exec(_constructor_source(fields, names), names)  # from the field names, nothing else
    new, fill = names["__new__"], names["_fill"]
    new.__qualname__ = f"{cls.__qualname__}.__new__"
    new.__module__ = cls.__module__
    new.__annotations__ = dict(vars(cls)["__init__"].__annotations__)
    setattr(cls, "__new__", new)  # noqa: B010 - mypy refuses a plain assignment
    delattr(cls, "__init__")  # object's: it takes the arguments __new__ used
    init_names = tuple(field.name for field in fields if field.init)
    setattr(cls, "__getnewargs_ex__", _new_arguments(init_names))  # noqa: B010
    setattr(cls, "__init_subclass__", classmethod(_subclassed(cls, fill)))  # noqa: B010
    return cls


def _constructor_source(fields: list[dataclasses.Field[Any]], names: dict[str, Any]) -> str:
    """The source of ``__new__`` (the class's own constructor, through its twin) and of
    ``_fill`` (a subclass's fields set through the slots' descriptors) for ``fields``;
    the defaults and setters they name go in ``names``."""
    positional: list[str] = []
    keywords: list[str] = []
    body: list[tuple[str, str]] = []
    for field in fields:
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
        names[f"_set_{field.name}"] = names["_owner"].__dict__[field.name].__set__
        body.append((field.name, value))
    keyword_part = ["*", *keywords] if keywords else []
    new_parameters = ", ".join(["_cls", *positional, *keyword_part])
    fill_parameters = ", ".join(["self", *positional, *keyword_part])
    return (
        f"def __new__({new_parameters}):\n"
        "    self = _twin()\n"
        + "".join(f"    self.{name} = {value}\n" for name, value in body)
        + "    self.__class__ = _owner\n"
        "    return self\n"
        f"def _fill({fill_parameters}):\n"
        + "".join(f"    _set_{name}(self, {value})\n" for name, value in body)
        + "    pass\n"
    )


def _new_arguments(init_names: tuple[str, ...]) -> Any:
    """``__getnewargs_ex__``: copies and pickles are made through ``__new__`` too."""

    def __getnewargs_ex__(self: object) -> tuple[tuple[()], dict[str, Any]]:
        return (), {name: getattr(self, name) for name in init_names}

    return __getnewargs_ex__


def _subclassed(base: type, fill: Callable[..., None]) -> Callable[..., None]:
    """``__init_subclass__``: a subclass is made by ``object.__new__`` and its own
    ``__init__`` (a dataclass's), or, with none of its own, filled as its base's fields
    are (``fill``). The base's twin cannot build it: the layouts differ."""

    def __new__(sub: type, *args: Any, **kwargs: Any) -> object:
        self: object = object.__new__(sub)
        below = sub.__mro__[: sub.__mro__.index(base)]
        if all("__init__" not in vars(kind) for kind in below):
            fill(self, *args, **kwargs)
        return self

    def __init_subclass__(cls: type[object], **kwargs: Any) -> None:
        super(cast(Any, base), cls).__init_subclass__(**kwargs)  # mypy: "not a type"
        setattr(cls, "__new__", __new__)  # noqa: B010 - mypy refuses a plain assignment

    return __init_subclass__
