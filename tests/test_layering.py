"""The package's layers (docs/architecture.md): imports point one way, the core never imports
torch (not even through a package __init__), no import cycles, and function-local imports only
where they keep ``memplan --help`` fast or scipy lazy."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import memplan

SRC = pathlib.Path(memplan.__file__).parent
# Lower layers first; a module may import its own layer and those below it.
LAYERS = (("memplan.errors",), ("memplan.core",), ("memplan.models",), ("memplan.tracing",),
          ("memplan.api",), ("memplan.runtime",), ("memplan.analysis", "memplan.distributed"),
          ("memplan.cli",))
# (importer prefix, imported prefix): function-local imports that are allowed, and why.
LOCAL_OK = (("memplan.cli.", "memplan."),  # subcommands import their work in run(): fast --help
            ("memplan.cli.", "torch"),
            ("memplan.core.planners.ilp", "scipy"))  # the MILP solver: only when ilp runs


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def layer(name: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS")


def imports(path: pathlib.Path, name: str, known: dict[str, pathlib.Path]
            ) -> list[tuple[str, bool]]:
    """(imported module, function-local?) of every import statement in the file, type-checking
    blocks excluded; ``from pkg import sub`` names the submodule when it is one."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    local = {id(n) for node in ast.walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(node)}
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in local) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in known else base, id(node) in local))
    return out


def test_core_imports_without_torch() -> None:
    """Every core module (and memplan, memplan.errors) imports with torch made unimportable."""
    core = [n for n in modules() if n == "memplan.core" or n.startswith("memplan.core.")]
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import memplan, memplan.errors\n"
        + "".join(f"import {n}\n" for n in core)
        + "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_imports_point_one_way() -> None:
    known = modules()
    wrong = []
    for name, path in known.items():
        if name == "memplan":
            continue  # the lazy front door names everything
        for target, _ in imports(path, name, known):
            if target.startswith("memplan.") and target != "memplan" and \
                    layer(target) > layer(name):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_no_import_cycles() -> None:
    known = modules()
    edges = {name: sorted({t for t, _ in imports(path, name, known) if t in known and t != name
                           and t != "memplan"})
             for name, path in known.items() if name != "memplan"}
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = "open"
        for m in edges.get(n, []):
            if state.get(m) == "open":
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def test_function_local_imports_are_the_allowed_ones() -> None:
    known = modules()
    found = []
    for name, path in known.items():
        for target, local in imports(path, name, known):
            if local and not any(name.startswith(a) and target.startswith(b)
                                 for a, b in LOCAL_OK):
                found.append(f"{name}: {target}")
    assert found == []
