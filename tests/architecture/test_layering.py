"""The layering holds: read from the source's own imports (AST), not from what happens to be loaded.

Layers, top to bottom: tools/ -> pipeline/ (cli -> router -> serve, bench -> engine, client -> models,
protocol, errors, paths) -> stages/<stage>/ -> the shared stage modules (stages/*.py) ->
stages/contracts/, shm/. No stage imports another stage or pipeline/; shm/ knows no stage;
stages/contracts/ imports the standard library and numpy only (anything else under
TYPE_CHECKING); and no import circle exists between modules.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ("tokenizer", "scheduler", "gpu_runner", "detokenizer")
PRODUCT_LAYERS = {  # a pipeline/ part may import only the parts listed for it (and itself)
    "cli": {"options", "chat", "router", "serve", "bench", "engine", "client", "models", "protocol", "errors",
            "paths"},
    "chat": {"options", "client", "errors", "paths"},  # `pipeline chat`, and the daemon it starts when none runs
    "options": {"serve", "models", "errors"},  # `start`'s and `worker`'s options and the configs they make
    "router": {"serve", "engine", "models", "protocol", "errors", "paths"},
    "serve": {"engine", "models", "protocol", "errors", "paths"},
    "bench": {"client", "protocol", "errors", "paths"},
    "engine": {"models", "errors"},  # LLM(model=...) resolves a GGUF file as `start` does
    "client": {"protocol", "errors", "paths"},
    "models": {"errors"},
    "protocol": {"errors"},
    "paths": {"errors"},
    "errors": set(),
}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(path: Path) -> list[str]:
    """Every module `path` imports when it runs (module level or inside functions), not counting
    what only type checkers see. `from a import b` counts as a.b when that is a module."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
               for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.append(candidate if _module_file(candidate) is not None else node.module)
    return found


def _module_file(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def product_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 1 else None


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    broken = []
    for path in sources("shm", "stages", "pipeline"):
        here = module_name(path)
        parts = here.split(".")
        own_stage = parts[1] if parts[0] == "stages" and len(parts) > 2 and parts[1] in STAGES else None
        for imported in runtime_imports(path):
            top = imported.split(".")[0]
            target = imported.split(".")
            if parts[0] == "shm" and top in ("stages", "pipeline", "tools"):
                broken.append(f"{here} imports {imported}: shm/ knows no stage and no product")
            elif parts[0] == "stages" and top in ("pipeline", "tools"):
                broken.append(f"{here} imports {imported}: stages/ never import the product")
            elif parts[:2] == ["stages", "contracts"]:
                allowed = top in sys.stdlib_module_names or top == "numpy" or target[:2] == ["stages", "contracts"]
                if not allowed:
                    broken.append(f"{here} imports {imported}: contracts import the standard library and numpy only")
            elif parts[0] == "stages" and top == "stages" and len(target) > 1 and target[1] in STAGES \
                    and target[1] != own_stage:
                broken.append(f"{here} imports {imported}: " + (
                    "a stage imports no other stage" if own_stage else "shared stage modules import no stage"))
            elif parts[0] == "pipeline" and top == "tools":
                broken.append(f"{here} imports {imported}: the product never imports tools/")
            elif parts[0] == "pipeline" and top == "pipeline" and product_part(here) and product_part(imported):
                source, target_part = product_part(here), product_part(imported)
                if source in PRODUCT_LAYERS and target_part != source and target_part not in PRODUCT_LAYERS[source]:
                    broken.append(f"{here} imports {imported}: pipeline/{source} sits below pipeline/{target_part}")
    assert broken == []


def test_no_import_circle() -> None:
    graph: dict[str, set[str]] = {}
    for path in sources("shm", "stages", "pipeline"):
        graph[module_name(path)] = {name for name in runtime_imports(path) if _module_file(name) is not None}
    circles = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []


def test_the_layering_test_sees_a_broken_import(tmp_path: Path) -> None:
    """The check itself: an import of another stage, under TYPE_CHECKING or not."""
    source = tmp_path / "stage_file.py"
    source.write_text("from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n    import torch\n"
                      "def f():\n    from stages.scheduler import scheduler\n")
    assert runtime_imports(source) == ["typing", "numpy", "stages.scheduler.scheduler"]


@pytest.mark.parametrize("module", ["stages.contracts", *sorted(
    module_name(p) for p in (REPO / "stages" / "contracts").glob("*.py") if p.name != "__init__.py")])
def test_contracts_load_no_model_stack_serializer_or_product(module: str) -> None:
    code = (f"import sys; import {module}; "
            "print(sorted(m for m in ('torch', 'msgspec', 'tokenizers', 'pipeline') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_the_client_library_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; "  # any import of torch now fails
            "from pipeline import Client, AsyncClient, SamplingParams, InvalidRequest; "
            "import pipeline.client, pipeline.protocol; "
            "Client('/nonexistent.sock'); print(SamplingParams(max_tokens=3).max_tokens)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3"
