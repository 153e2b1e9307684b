"""The import arrows of docs/architecture.md hold: no module imports upward, no cycles.

The layers are read from the page's "Layers" table (first row lowest), so the page and
the code cannot drift apart. Imports inside ``if TYPE_CHECKING:`` are not dependencies;
imports inside functions (lazy ones) are.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in (ROOT / "aimu").rglob("*.py")}


def layers() -> list[tuple[str, list[str]]]:
    """(layer, names) from the page's Layers table, lowest first.

    A name is a module or package (``aimu.aio.store``: it and everything under it);
    ``aimu.aio.*`` means every module under ``aimu.aio`` that no longer name claims.
    """
    section = PAGE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`aimu" in line]
    found = []
    for row in rows:
        name = row.split("|")[1].strip().strip("*")
        found.append((name, re.findall(r"`(aimu[\w.]*(?:\.\*)?)`", row)))
    return found


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int:
    """The layer of the longest name that claims ``module``."""
    best, index = -1, -1
    for position, (_, names) in enumerate(table):
        for name in names:
            wildcard = name.endswith(".*")
            prefix = name.removesuffix(".*")
            claims = module.startswith(prefix + ".") or (module == prefix and not wildcard)
            if claims and len(name) - 2 * wildcard > best:
                best, index = len(name) - 2 * wildcard, position
    assert index >= 0, f"{module} is in no layer of {PAGE.name}: add it to the Layers table"
    return index


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, *, typing_too: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing_too:
            for other in node.orelse:
                yield from _imports(other, typing_too=typing_too)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        else:
            yield from _imports(node, typing_too=typing_too)


def dependencies(module: str, *, typing_too: bool = False) -> set[str]:
    """The aimu modules ``module`` imports (a package's own submodules resolved);
    ``typing_too``: with the imports made only for type checking."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text()), typing_too=typing_too):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        found.update(t for t in targets if t in MODULES and t != module)
    return found


GRAPH = {module: dependencies(module) for module in MODULES}
#: With the imports made only for type checking: a cycle there is still two modules that
#: cannot be read apart (a small protocol on the lower side breaks it).
TYPING_GRAPH = {module: dependencies(module, typing_too=True) for module in MODULES}


def test_every_layer_names_modules_that_exist() -> None:
    table = layers()
    assert len(table) >= 5, table
    for name, prefixes in table:
        for prefix in prefixes:
            prefix = prefix.removesuffix(".*")
            assert any(m == prefix or m.startswith(prefix + ".") for m in MODULES), (
                f"layer {name!r} names {prefix}, which does not exist"
            )


def test_no_module_imports_a_higher_layer() -> None:
    table = layers()
    upward = [
        f"{module} ({table[layer_of(module, table)][0]}) imports {target} "
        f"({table[layer_of(target, table)][0]})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target, table) > layer_of(module, table)
    ]
    assert upward == [], "\n".join(upward)


def test_the_library_never_imports_the_test_kit() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if not module.startswith("aimu.testing")
        for target in targets
        if target.startswith("aimu.testing")
    ]
    assert offenders == [], offenders


#: Import edges allowed to close a cycle: the deprecated ``ModelClient.chat()`` calls the
#: helper that replaced it (a lazy import inside that method alone); both go together.
_DEPRECATED_EDGES = {("aimu.aio.providers.base", "aimu.aio.chat")}


def test_the_deprecated_edges_are_the_shims_alone() -> None:
    """Each allowed edge is one lazy import, inside the deprecated ``chat()`` shim."""
    for module, target in _DEPRECATED_EDGES:
        tree = ast.parse(MODULES[module].read_text())
        importers = {
            function.name
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(function)
            if isinstance(node, ast.ImportFrom) and node.module == target
        }
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == target]
        assert importers == {"chat"} and top == [], (module, target, importers)


@pytest.mark.parametrize("graph", [GRAPH, TYPING_GRAPH], ids=["imports", "type-only too"])
def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    graph = {m: {t for t in ts if (m, t) not in _DEPRECATED_EDGES} for m, ts in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == [], "\n".join(" -> ".join(cycle) for cycle in cycles)


def _string_sets(tree: ast.AST) -> Iterator[tuple[int, frozenset[str]]]:
    """Each set, tuple or list literal of two or more strings in ``tree`` (not a
    ``Literal[...]`` subscript's), with its line."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            skip.update(id(inner) for inner in ast.walk(node.slice))
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.Set | ast.Tuple | ast.List):
            continue
        values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if len(values) == len(node.elts) >= 2 and all(isinstance(v, str) for v in values):
            yield node.lineno, frozenset(values)


def test_how_a_run_ends_is_spelled_once() -> None:
    """The reply texts of aimu.aio.ends are defined there only: every other module
    imports them (a copy drifts: two Temporal sets once lacked limited)."""
    from aimu.aio import ends

    texts = {
        name: value for name, value in vars(ends).items()
        if name.isupper() and isinstance(value, str)
    }
    assert "INTERRUPTED" in texts
    copies = []
    for module, path in MODULES.items():
        if module == "aimu.aio.ends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in texts.values():
                copies.append(f"{module}:{node.lineno} spells {node.value!r}")
    assert copies == [], "\n".join(copies)


#: The vocabulary module; the words of every status type aimu has.
_VOCABULARY = "aimu.aio.status"
#: Modules that speak other protocols' statuses (OpenAI Responses' ``completed``...).
_OTHER_WORDS = ("aimu.aio.providers.", "aimu.testing.")


def _status_words() -> frozenset[str]:
    from aimu.aio import status

    found: set[str] = set()
    for value in vars(status).values():
        if getattr(value, "__module__", None) == "typing" or type(value).__name__ in (
            "UnionType", "_UnionGenericAlias", "_LiteralGenericAlias"
        ):
            found.update(status.words(value))
    return frozenset(found)


def _literal_words(tree: ast.AST) -> Iterator[tuple[int, frozenset[str]]]:
    """Each ``Literal[...]`` subscript's strings in ``tree``, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and (
            (isinstance(node.value, ast.Name) and node.value.id == "Literal")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "Literal")
        ):
            inner = ast.walk(node.slice)
            values = {n.value for n in inner if isinstance(n, ast.Constant)}
            yield node.lineno, frozenset(v for v in values if isinstance(v, str))


def test_a_runs_status_words_are_spelled_in_one_module() -> None:
    """Every status type and every set of statuses is aimu.aio.status's: a type elsewhere
    is a union of its types, a grouping one of its sets (``FINAL``, ``RECOVERABLE``...).
    Code elsewhere compares a typed status with one word, which mypy checks. (Before:
    nine modules spelled a status type or set, and ``FINAL`` meant two things.)"""
    words = _status_words()
    assert {"pending", "completed", "paused", "lost", "in_progress", "idle"} <= words
    spelled = []
    for module, path in MODULES.items():
        if module == _VOCABULARY or module.startswith(_OTHER_WORDS):
            continue
        tree = ast.parse(path.read_text())
        for line, found in _literal_words(tree):
            if len(found & words) >= 2:
                spelled.append(f"{module}:{line} Literal of {sorted(found & words)}")
        for line, found in _string_sets(tree):
            if found <= words:
                spelled.append(f"{module}:{line} a set of {sorted(found)}")
    assert spelled == [], "\n".join(spelled)


def test_the_handle_states_are_the_handle_statuses() -> None:
    """A RunHandle's states (plain strings, for its hot path) are the handle statuses
    by their own names, and two of its own for a run that is being stopped."""
    from aimu.aio import _handle_states, status

    states = {v for k, v in vars(_handle_states.HandleState).items() if k.isupper()}
    assert states == status.HANDLE_STATUSES | {"cancelling", "expiring"}


#: The agent's rooms (aimu/aio/agent/) that never import each other, nor the package
#: (the Agent class): each is a function of the session and the run's state.
_STEPS = ("turn", "tool_round", "settle")
_ROOMS = (
    "config", "transfer", "base", "state", "session", "turn", "tool_round", "settle", "tree",
    "handoffs", "loop", "wall",
)
#: Each room and the rooms it may import (type-only imports too), lowest first.
_BELOW = {
    "wall": set(), "state": {"wall"}, "transfer": set(), "config": {"transfer"},
    "base": {"config"}, "session": {"config", "state", "transfer", "base"},
    "turn": {"session", "state", "wall"}, "tool_round": {"session", "state", "wall"},
    "settle": {"session", "state"},
    # the steps that hold other agents: through the seam (base), never the Agent class
    "tree": {"base", "config", "session", "state"},
    "handoffs": {"base", "config", "session", "transfer"},
    "loop": {*_ROOMS} - {"loop"},
}


def test_the_agents_rooms_import_in_one_direction() -> None:
    """wall <- state <- session <- turn, tool_round, settle <- loop <- the Agent class;
    transfer <- config <- base (the seam) <- session, and tree and handoffs hold other
    agents through the seam: a step never reaches another step, the driver, or the Agent.
    Every module of the package is a room (a new one says where it stands)."""
    package = "aimu.aio.agent"
    rooms = {f"{package}.{name}" for name in _ROOMS}
    assert rooms <= set(MODULES), sorted(rooms - set(MODULES))
    inside = {m for m in MODULES if m.startswith(package + ".")}
    assert inside == rooms, f"rooms without a place in _BELOW: {sorted(inside - rooms)}"
    assert set(_BELOW) == set(_ROOMS)
    wrong = []
    for name, allowed in _BELOW.items():
        module = f"{package}.{name}"
        found = {t.rpartition(".")[2] for t in TYPING_GRAPH[module] if t.startswith(package)}
        found.discard("agent")  # the package itself, as aimu.aio.agent
        if any(t == package for t in TYPING_GRAPH[module]):
            wrong.append(f"{module} imports the package (the Agent class)")
        wrong += [f"{module} imports {package}.{t}" for t in sorted(found - allowed)]
    assert wrong == [], "\n".join(wrong)


#: The agent's rooms that hold the Runnable class: the seam to other agents and runnables.
_HOLD_THE_RUNNABLE = {"base", "transfer"}


def test_the_agents_driver_never_imports_the_runnable() -> None:
    """The loop and the steps it drives take a run's options, its clock and the scopes
    from below (``aimu.aio._run_options``, ``aimu.aio.scope``); the Runnable class stands
    above them, with the Agent class, and only the seam (base, transfer) names it.
    (Before: loop, state and tree imported runnable.py for RunOptions and options_in.)"""
    package = "aimu.aio.agent"
    wrong = [
        f"{package}.{name} imports aimu.aio.runnable"
        for name in sorted(set(_ROOMS) - _HOLD_THE_RUNNABLE)
        if "aimu.aio.runnable" in TYPING_GRAPH[f"{package}.{name}"]
    ]
    below = TYPING_GRAPH["aimu.aio._run_options"]
    wrong += [f"aimu.aio._run_options imports {t}" for t in sorted(below)
              if t == "aimu.aio.runnable" or t.startswith(package)]
    assert wrong == [], "\n".join(wrong)


def test_the_agents_driver_calls_only_downward() -> None:
    """The loop claims and releases the session through the run seat it is handed
    (``aimu.aio.scope.RunSeat``): no function of the driver or its settling takes a
    callable, so none can call back up into the Runnable that started the run.
    (Before: ``run_events`` and ``settle`` took the Runnable's ``_open_scope`` and
    ``_close_scope`` bound methods.)"""
    wrong = []
    for name in ("loop", "settle"):
        path = MODULES[f"aimu.aio.agent.{name}"]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            arguments = node.args
            for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                annotation = ast.unparse(argument.annotation) if argument.annotation else ""
                if "Callable" in annotation or "Awaitable" in annotation:
                    wrong.append(f"{path.name}:{node.lineno} {node.name}({argument.arg})")
    assert wrong == [], "\n".join(wrong)


def test_nothing_outside_the_agent_reaches_into_its_session() -> None:
    """An agent's session (``agent._session``: transcript, store writer, approvals) is
    the agent package's; other code uses the agent's public names (serve's recovery
    reads ``agent.session_writer``, not ``agent._session.durable.writer``)."""
    wrong = []
    for module, path in sorted(MODULES.items()):
        if module == "aimu.aio.agent" or module.startswith("aimu.aio.agent."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "_session"
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                wrong.append(f"{module}:{node.lineno}")
    assert wrong == [], wrong


def test_temporal_never_imports_serve() -> None:
    """``aimu worker`` runs without the serve extra's modules: what the worker and the
    server share (the agent options, the store and agent factory, the bounded exit)
    lives in modules of their own, and serve uses Temporal, never the other way."""
    wrong = {
        f"{module} imports {dependency}"
        for module in MODULES
        if module == "aimu.temporal" or module.startswith("aimu.temporal.")
        for dependency in dependencies(module, typing_too=True)
        if dependency == "aimu.serve" or dependency.startswith("aimu.serve.")
    }
    assert wrong == set()


#: What a backend of serve may import of serve outside its package.
_BACKENDS_SEE = {"aimu.serve.errors", "aimu.serve.ids"}
#: The backends' shared parts, each with the backend modules it may import: none imports
#: a backend (local, redis, temporal), and the contract (base) nothing of the package.
_BACKEND_PARTS = {
    "base": set(), "launcher": set(), "run_log": {"base"}, "decisions": {"base"},
    "hosted": {"base", "launcher", "decisions"},
}


def test_a_served_run_travels_one_way() -> None:
    """routes -> runs (the service) -> a backend -> launcher -> the agent: a backend
    imports of serve its own package (its contract is ``backends/base.py``), serve's
    errors and ids; never the runs service, recovery, the routes or the application (they
    once held what the backends needed: ``open_agent``, ``RunView``, ``resumed_here``).
    The service sees the backends through the contract only, and the backends' shared
    parts import no backend. (Before: launcher.py imported runs.py, which the routes call.)"""
    package = "aimu.serve.backends"
    wrong = []
    for module in sorted(MODULES):
        if module != package and not module.startswith(package + "."):
            continue
        for target in sorted(TYPING_GRAPH[module]):
            serve = target == "aimu.serve" or target.startswith("aimu.serve.")
            ours = target == package or target.startswith(package + ".")
            if serve and not ours and target not in _BACKENDS_SEE:
                wrong.append(f"{module} imports {target}")
    for name, allowed in _BACKEND_PARTS.items():
        module = f"{package}.{name}"
        found = {t.rpartition(".")[2] for t in TYPING_GRAPH[module] if t.startswith(package)}
        wrong += [f"{module} imports {package}.{t}" for t in sorted(found - allowed)]
    service = {t for t in TYPING_GRAPH["aimu.serve.runs"] if t.startswith(package)}
    wrong += [f"aimu.serve.runs imports {t}" for t in sorted(service - {f"{package}.base"})]
    assert wrong == [], "\n".join(wrong)


def _private_names(path: Path) -> set[str]:
    """The private names the classes of ``path`` define (methods, ``self._x``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
            node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_steps_holding_agents_use_the_seam() -> None:
    """A tree's calls and handoffs reach other agents through AgentBase's public names:
    no private name of an agent (``_config``, ``_session``, ``_finish``...), no ``Any``
    stand-in for the package's own types, no look-alike Protocol, no ``object.__new__``."""
    package = ROOT / "aimu" / "aio" / "agent"
    private = _private_names(package / "__init__.py") | _private_names(
        ROOT / "aimu" / "aio" / "runnable.py"
    )
    assert {"_config", "_session", "_finish", "_setup"} <= private
    found = []
    for name in ("tree", "handoffs", "transfer"):
        source = (package / f"{name}.py").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{name}.py:{node.lineno} reads the agent's .{node.attr}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and (
                node.value.id == "Any"
            ):
                found.append(f"{name}.py:{node.lineno} aliases Any")
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases
            ):
                found.append(f"{name}.py:{node.lineno} declares a look-alike Protocol")
        if "object.__new__" in source:
            found.append(f"{name}.py uses object.__new__")
    assert found == [], "\n".join(found)


def test_no_module_in_aimu_is_over_800_lines() -> None:
    """A module past 800 lines holds more than one concept: give each its own."""
    long = {
        module: lines
        for module, path in MODULES.items()
        if (lines := len(path.read_text().splitlines())) > 800
    }
    assert long == {}


def test_no_function_in_aimu_is_over_60_lines() -> None:
    """A function longer than a screen does more than one job: split it."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{module}.{node.name} (line {node.lineno}): {lines} lines")
    assert long == [], "\n".join(long)


def test_only_the_session_knows_about_the_store_writer() -> None:
    """The loop and its steps call the session; whether it has a store (and an open
    writer) is the session's business (Session / StoredSession), never a branch here."""
    package = ROOT / "aimu" / "aio" / "agent"
    branching = [
        f"{name}.py:{node.lineno}"
        for name in ("loop", "turn", "tool_round", "settle", "state")
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "writer"
    ]
    assert branching == [], branching


#: Functions that still read a request's kind for their own answers (serve's backends:
#: their conflict messages; being reworked in issue 43's item 7, they can ask the Steer:
#: ``must_be_taken``, ``what``).
_KIND_READERS = {"aimu.serve.backends.local.request"}


def _kinds_compared(function: ast.AST, kinds: frozenset[str]) -> set[str]:
    """The request kinds ``function`` compares a ``kind`` (or ``x.kind``) with."""
    found: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any((isinstance(s, ast.Name) and s.id == "kind")
               or (isinstance(s, ast.Attribute) and s.attr == "kind") for s in sides):
            found.update(c.value for s in sides for c in ast.walk(s)
                         if isinstance(c, ast.Constant) and c.value in kinds)
    return found


def test_a_requests_kind_is_dispatched_in_one_place() -> None:
    """A Steer's kind is dispatched by aimu.aio.steering alone (``steer()`` applies it;
    the Steer says what a carrier needs: ``must_be_taken``, ``what``, its JSON). A carrier
    has one ``request(run_id, steer)`` and its verbs call it. (Before: RedisControl, its
    worker, RunsClient and the Temporal turn each dispatched the kind again.)"""
    from aimu.aio.steering import STEER_KINDS

    dispatching = []
    for module, path in MODULES.items():
        if module == "aimu.aio.steering":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kinds = _kinds_compared(node, STEER_KINDS)
                if len(kinds) >= 2 and f"{module}.{node.name}" not in _KIND_READERS:
                    dispatching.append(f"{module}.{node.name} reads {sorted(kinds)}")
    assert dispatching == [], "\n".join(dispatching)


def _transport_reads(path: Path) -> Iterator[int]:
    """The lines of ``path`` reading a model client's ``messages`` (``client.messages``,
    ``agent.model_client.messages``, ``session.client.messages``...)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr == "messages"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else (
            owner.attr if isinstance(owner, ast.Attribute) else "")
        if name.endswith("client") or name in ("model", "models"):
            yield node.lineno


def _model_client_classes(trees: dict[str, ast.Module]) -> set[str]:
    """The names of ModelClient and every class in aimu deriving from it."""
    found, grew = {"ModelClient"}, True
    while grew:
        before = len(found)
        found |= {
            node.name
            for tree in trees.values()
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and any(
                (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) in found
                for b in node.bases
            )
        }
        grew = len(found) > before
    return found


def _own_reads(trees: dict[str, ast.Module], classes: set[str]) -> Iterator[str]:
    """Where a model client reads its own ``self.messages`` (the property and the
    deprecated ``chat()`` shim, both on ModelClient, aside)."""
    for module, tree in trees.items():
        for cls in ast.walk(tree):
            if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
                continue
            for function in cls.body:
                if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) or (
                    cls.name == "ModelClient" and function.name in ("chat", "messages")
                ):
                    continue
                for node in ast.walk(function):
                    if (
                        isinstance(node, ast.Attribute)
                        and node.attr == "messages"
                        and isinstance(node.value, ast.Name)
                        and node.value.id == "self"
                    ):
                        yield f"{module}:{node.lineno} ({cls.name}.{function.name})"


def test_nothing_reads_a_transports_messages() -> None:
    """The session owns the transcript and a model client holds no conversation: its
    ``messages`` is the user's view (``agent.model_client.messages``), which nothing in
    aimu reads but the session taking over what a client's deprecated chat() said, once,
    and that shim (``aimu.aio.chat`` keeps the conversation with its caller)."""
    allowed = {"aimu.aio.agent.session"}
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    own = list(_own_reads(trees, _model_client_classes(trees)))
    assert own == [], "\n".join(own)
    reads = [
        f"{module}:{line}"
        for module, path in MODULES.items()
        if module not in allowed
        for line in _transport_reads(path)
    ]
    assert reads == [], "\n".join(reads)
    session = list(_transport_reads(MODULES["aimu.aio.agent.session"]))
    assert len(session) == 1, session  # the hand-over, in Session.__init__



def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


def _imported_from(module: str, node: ast.ImportFrom) -> str:
    """The module ``node`` (in ``module``) imports from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def test_no_public_class_name_is_defined_twice() -> None:
    """One name per concept: a public class (one of a public module, or one a public
    module exports) named like another means two things at the next crossing
    (``serve.models`` names its schemas ``RunRecordSchema``, not a second ``RunRecord``)."""
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    classes = {
        module: {node.name for node in tree.body
                 if isinstance(node, ast.ClassDef) and not node.name.startswith("_")}
        for module, tree in trees.items()
    }
    where: dict[str, set[str]] = {}
    for module, tree in trees.items():
        if not _is_public(module):
            continue
        for name in classes[module]:
            where.setdefault(name, set()).add(module)
        exported: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                exported = set(ast.literal_eval(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _imported_from(module, node)
                for alias in node.names:
                    if alias.name in exported and alias.name in classes.get(source, ()):
                        where.setdefault(alias.name, set()).add(source)
    twice = {name: sorted(modules) for name, modules in where.items() if len(modules) > 1}
    assert twice == {}
