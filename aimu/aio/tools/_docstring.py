"""Reading a tool's docstring: its summary line and the Google-style ``Args:`` entries."""

from __future__ import annotations

import inspect
import re

__all__ = ["own_doc", "parse_docstring"]

_ARGS_HEADERS = frozenset(
    {
        "args",
        "arguments",
        "parameters",
        "params",
        "keyword args",
        "keyword arguments",
        "attributes",
        "fields",
    }
)
_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^\**(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """The summary (first paragraph, one line) and the Google-style ``Args:`` entries."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _HEADER.match(line):
            break
        summary.append(line.strip())
    described: dict[str, str] = {}
    index = 0
    while index < len(lines):
        header = _HEADER.match(lines[index])
        index += 1
        if header is None or header.group(1).strip().lower() not in _ARGS_HEADERS:
            continue
        name: str | None = None
        entry_indent = -1
        while index < len(lines):
            line = lines[index]
            if not line.strip():
                index += 1
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:  # the next section (or prose) starts
                break
            index += 1
            match = _ENTRY.match(line.strip())
            if match and (entry_indent < 0 or indent <= entry_indent):
                entry_indent = indent
                name = match.group(1)
                described[name] = match.group(2).strip()
            elif name is not None:
                described[name] = f"{described[name]} {line.strip()}".strip()
    return " ".join(summary), described



def own_doc(cls: type) -> str | None:
    """A class's docstring, unless it is the signature ``@dataclass`` writes in its place."""
    doc = cls.__doc__
    if doc and doc.startswith(f"{cls.__name__}("):
        return None
    return doc

