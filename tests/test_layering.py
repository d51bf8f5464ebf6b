"""The package's layering (docs/architecture.md): no import cycle, configs as leaves, a torch-free scheduler side.

Module-level imports only, read from the source (imports inside functions are deferred on purpose, and those under
`if TYPE_CHECKING` never run)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "vllm"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Everything the module imports at module level, vllm's modules and third-party packages alike."""
    f = MODULES[name]
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.parse(f.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, ast.Import):
                out |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - n.level + 1] + [base]).strip(".")
                subs = {f"{base}.{a.name}" for a in n.names} & MODULES.keys()
                # `from pkg import submodule` needs the submodule, not the rest of the package's __init__
                out |= subs if len(subs) == len(n.names) else {base} | subs
    return out - {name}


GRAPH = {name: {m for m in _imports(name) if m in MODULES} for name in MODULES}


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(GRAPH[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None
    for v in sorted(GRAPH):
        if v not in state and (found := visit(v)):
            return found
    return None


def _reachable(start: str, skip: frozenset[str] | set[str] = frozenset()) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in GRAPH[todo.pop()] - seen - skip:
            seen.add(w)
            todo.append(w)
    return seen


def test_no_import_cycle():
    assert _cycle() is None, " -> ".join(_cycle())


def test_config_imports_nothing_from_model_executor():
    assert not {m for m in _reachable("vllm.config") if m.startswith("vllm.model_executor")}


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("vllm.core.")))
def test_the_scheduler_side_imports_no_torch(name):
    """Neither directly nor through another module, except vllm.config (its fields hold torch dtypes)."""
    reached = {name} | {m for m in _reachable(name, skip={"vllm.config"})}
    torch_users = sorted(m for m in reached if any(i == "torch" or i.startswith("torch.") for i in _imports(m)))
    assert not torch_users, torch_users
