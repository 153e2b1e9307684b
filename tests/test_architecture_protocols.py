"""One event stream for every protocol (issue 43, item 5): the adapters share
``aimu.serve.protocols.EventStream``, which decodes a run's events once and keeps their
nesting; an adapter keeps only its wire format.

Held here: no adapter reads an event's ``"type"`` or compares a string with one of
aimu's event tags (the decoding is the base's alone); each adapter translates through
an ``EventStream`` subclass; the modules stay within the house's sizes.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import get_args

import pytest

from aimu.aio.events import Event

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ["aimu/serve/ag_ui.py", "aimu/serve/ai_sdk.py", "aimu/serve/a2a.py",
            "aimu/serve/mcp_agent.py"]
PROTOCOLS = [*ADAPTERS, *(str(p.relative_to(ROOT))
                          for p in sorted((ROOT / "aimu/serve/protocols").glob("*.py")))]
#: aimu's event tags: "text", "tool_call", "run_finished", ...
TAGS = frozenset(str(cls.__dataclass_fields__["type"].default) for cls in get_args(Event))


def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), path)


def _reads_type(node: ast.AST) -> bool:
    """``x.get("type")`` or ``x["type"]``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "get" and any(
            isinstance(arg, ast.Constant) and arg.value == "type" for arg in node.args[:1])
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and (
        node.slice.value == "type")


def _tags_in(node: ast.AST) -> set[str]:
    """The event tags a comparison operand spells (a string, or a tuple/set of them)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return {item.value for item in items
            if isinstance(item, ast.Constant) and item.value in TAGS}


@pytest.mark.parametrize("path", ADAPTERS)
def test_no_adapter_reads_or_compares_an_events_type(path: str) -> None:
    found = []
    for node in ast.walk(_tree(path)):
        if _reads_type(node):
            found.append(f"line {node.lineno}: reads a 'type'")  # type: ignore[attr-defined]
        if isinstance(node, ast.Compare):
            tags = set().union(*(_tags_in(side) for side in [node.left, *node.comparators]))
            if tags:
                found.append(f"line {node.lineno}: compares with {sorted(tags)}")
        if isinstance(node, ast.MatchValue) and _tags_in(node.value):
            found.append(f"line {node.lineno}: matches {sorted(_tags_in(node.value))}")
    assert not found, f"{path} decodes events itself (EventStream does): {found}"


def test_the_check_catches_what_the_adapters_did() -> None:
    """The checks above would have caught the old translators' lines."""
    old = ast.parse('kind = event.get("type")\nif kind in ("text", "thinking"): pass\n'
                    'ok = part["type"] == "text"')
    assert sum(_reads_type(node) for node in ast.walk(old)) == 2
    compares = [node for node in ast.walk(old) if isinstance(node, ast.Compare)]
    assert [_tags_in(node.comparators[0]) for node in compares] == [{"text", "thinking"},
                                                                      {"text"}]


@pytest.mark.parametrize("path", ADAPTERS)
def test_each_adapter_translates_through_an_event_stream(path: str) -> None:
    bases = [
        ast.unparse(base) for node in ast.walk(_tree(path)) if isinstance(node, ast.ClassDef)
        for base in node.bases
    ]
    assert any(base.startswith("EventStream[") for base in bases), path


def test_the_decoders_cover_every_field_of_the_events_they_decode() -> None:
    from aimu.serve.protocols.stream import _DECODERS

    for tag, decoder in _DECODERS.items():
        cls = next(c for c in get_args(Event) if c.__dataclass_fields__["type"].default == tag)
        fields = [f.name for f in dataclasses.fields(cls) if f.init]
        source = ast.unparse(_function(decoder.__name__))
        missing = [name for name in fields if name != "path" and f"'{name}'" not in source]
        assert not missing, f"{decoder.__name__} leaves out {missing} of {cls.__name__}"


def _function(name: str) -> ast.FunctionDef:
    tree = _tree("aimu/serve/protocols/stream.py")
    return next(node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name == name)


@pytest.mark.parametrize("path", PROTOCOLS)
def test_protocol_modules_keep_the_house_sizes(path: str) -> None:
    text = (ROOT / path).read_text()
    assert text.count("\n") <= 800, f"{path}: {text.count(chr(10))} lines (800 at most)"
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1}"  # type: ignore[operator]
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 60  # type: ignore[operator]
    ]
    assert not long, f"{path}: functions over 60 lines: {long}"
