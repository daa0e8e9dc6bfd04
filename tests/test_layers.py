"""The layers import one way (engine <- execapp <- plugins) and the import graph has no cycle.

Two kinds of check. Static ones read every module of the project with ``ast``: the graph of
module-level imports among project modules (what runs at import) has no cycle; execapp names
no plugins module anywhere (no import, lazy or not, and no dotted path in a string); inside
plugins/ every project import is at module level. Dynamic ones import one layer alone in a fresh
interpreter and look at ``sys.modules``: the engine pulls in no Django and nothing of execapp
or plugins outside itself; the Django-free parts of plugins (the spec, the runtimes, the
strategies) pull in no Django; execapp's modules all import, with the plugins app not
installed, without importing plugins.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from plugins.runtimes import registry

ROOT = Path(__file__).resolve().parent.parent
#: The project's own packages (tests and bench are clients of these, not layers).
PACKAGES = ("config", "execapp", "plugins")

#: Modules of plugins/ that must import without Django: the spec, the errors, every runtime
#: module and the registry, the strategies and the loaded plugin (registered runtimes added below).
DJANGO_FREE = ["plugins.spec", "plugins.errors", "plugins.runtimes", "plugins.runtimes.registry",
               "plugins.runtimes.base", "plugins.runtimes.host", "plugins.runtimes.deadline_net",
               "plugins.runtimes.kvstore", "plugins.strategies", "plugins.loaded"]
#: The one place in plugins/ where a project import may sit in a function: Django imports
#: apps.py before models can load, so ready() imports the modules that define or use them.
FUNCTION_IMPORTS_ALLOWED = {"plugins.apps"}


@cache
def project_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of PACKAGES: name -> (path, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(body: list[ast.stmt], module_level: bool, in_function: bool = False):  # type: ignore[no-untyped-def]
    """(statement, inside a function) for every statement; ``module_level``: only what runs at
    import (no function bodies, no ``if TYPE_CHECKING:`` blocks)."""
    for node in body:
        yield node, in_function
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not module_level:
                yield from _statements(node.body, module_level, True)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _statements(node.orelse, module_level, in_function)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None) or []
            for child in children:
                if isinstance(child, ast.ExceptHandler):
                    yield from _statements(child.body, module_level, in_function)
            yield from _statements([c for c in children if isinstance(c, ast.stmt)], module_level, in_function)


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(module: str, module_level: bool) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` of each import in ``module`` (absolute
    names; ``from p import name`` gives ``p.name`` when that is a project module)."""
    path, is_package = project_modules()[module]
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node, in_function in _statements(_tree(path).body, module_level):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, in_function) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full if full in project_modules() else base, node.lineno, in_function))
    return out


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """Import edges among project modules (``module_level``: only the imports that run at import
    time). Importing ``a.b.c`` also runs ``a`` and ``a.b``; those count too, except the packages
    the importer itself is in (already running)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        own = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
        for target, _, _ in imports(module, module_level):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix not in own:
                    graph[module].add(prefix)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_the_graph_is_read() -> None:
    # The checks below rest on these two: a cycle is found, and real edges are seen.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "plugins.runtimes.registry" in graph["plugins.spec"]
    assert "plugins.runtimes" in graph["plugins.spec"]  # the package runs first
    assert "execapp.engine" in graph["plugins.loaded"]


def test_the_import_graph_among_project_modules_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    # Not even through an import deferred into a function (what held the old circles together:
    # plugins.models -> plugins.kv -> plugins.models, models -> loaded -> sync -> models...).
    cycle = find_cycle(import_graph(module_level=False))
    assert cycle is None, "import cycle through a deferred import: " + " -> ".join(cycle or [])


def test_plugins_imports_project_modules_at_module_level_only() -> None:
    deferred = [f"{m}:{line} imports {target}" for m in project_modules() if m.startswith("plugins")
                and m not in FUNCTION_IMPORTS_ALLOWED for target, line, in_function in imports(m, module_level=False)
                if in_function and target.split(".")[0] in PACKAGES]
    assert deferred == []


_PLUGINS_PATH = re.compile(r"^plugins(\.\w+)+(:\w+)?$")


def test_execapp_never_names_the_plugins_app() -> None:
    found = []
    for module, (path, _) in project_modules().items():
        if not module.startswith("execapp"):
            continue
        found += [f"{module}:{line} imports {target}" for target, line, _ in imports(module, module_level=False)
                  if target.split(".")[0] == "plugins"]
        tree = _tree(path)
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        found += [f"{module}:{n.lineno} names {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
                  and _PLUGINS_PATH.match(n.value)]
    assert found == [], "execapp reaches up into plugins (register through execapp.extensions instead)"


def imported_alone(module: str) -> list[str]:
    """``sys.modules`` after importing ``module`` alone in a fresh interpreter (no Django settings)."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
            "print(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code, module], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _django(names: list[str]) -> list[str]:
    return [n for n in names if n == "django" or n.startswith("django.")]


def _execapp_outside_engine(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("execapp.") and not n.startswith("execapp.engine")]


def test_the_engine_imports_alone() -> None:
    names = imported_alone("execapp.engine")
    assert "execapp.engine.engine" in names
    assert _django(names) == []
    assert _execapp_outside_engine(names) == []
    assert [n for n in names if n.split(".")[0] == "plugins"] == []


def test_the_supervisor_imports_no_django_and_no_engine() -> None:
    # execapp.serve watches its workers from outside: the slots file and the quarantine list are
    # all it needs of the watchdog (the worker's side and its service stay in the workers).
    names = imported_alone("execapp.serve")
    assert {"execapp.watchdog", "execapp.watchdog_quarantine"} <= set(names)
    assert "execapp.watchdog_service" not in names
    assert _django(names) == []
    assert [n for n in names if n.startswith("execapp.engine")] == []


def _runtime_modules() -> list[str]:
    # Every registered runtime's module, whatever the registry lists (a new one is checked too).
    paths = [r.compile for r in registry.all_runtimes()] + [r.text_to_binary for r in registry.all_runtimes()]
    return sorted({p.partition(":")[0] for p in paths if isinstance(p, str)})


@pytest.mark.parametrize("module", DJANGO_FREE + _runtime_modules())
def test_the_django_free_parts_of_plugins_import_without_django(module: str) -> None:
    names = imported_alone(module)
    assert module in names
    assert _django(names) == [], f"{module} pulls in Django"
    assert _execapp_outside_engine(names) == [], f"{module} pulls in execapp beyond its engine"


_EXECAPP_WITHOUT_PLUGINS = """
import importlib, json, sys
import django
from django.conf import settings
import config.settings as base
values = {k: getattr(base, k) for k in dir(base) if k.isupper()}
values["INSTALLED_APPS"] = [a for a in values["INSTALLED_APPS"] if a.split(".")[0] != "plugins"]
settings.configure(**values)
django.setup()
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"failed": failed, "plugins": sorted(n for n in sys.modules if n.split(".")[0] == "plugins")}))
"""


def test_execapp_imports_without_the_plugins_app() -> None:
    modules = sorted(m for m in project_modules() if m.startswith("execapp"))
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", _EXECAPP_WITHOUT_PLUGINS, json.dumps(modules)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"failed": {}, "plugins": []}
