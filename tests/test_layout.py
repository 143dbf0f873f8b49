"""The package's layout holds: no import cycles, and imports point one way down the pipeline
(measurement -> fixtures -> GGUF -> calibration -> models, llama.cpp runtime, errors), with the
commands above every stage (imported by no stage), and the CLI on top of them, imported by nothing
but ``__main__`` and reaching the commands only. Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "nbl_gguf"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# an import must go to a module of equal or lower rank (the longest matching prefix decides)
RANKS = {
    "nbl_gguf": 0,  # the package itself (__version__)
    "nbl_gguf.errors": 0,
    "nbl_gguf.architectures": 0,
    "nbl_gguf.kv_cache": 0,
    "nbl_gguf.outputs": 0,
    "nbl_gguf.models": 0,
    "nbl_gguf.model_source": 0,
    "nbl_gguf.gguf_header": 0,  # a GGUF header parsed alone (model_source reads it)
    "nbl_gguf.gguf_rope": 0,  # a GGUF's rope scaling told to transformers (model_source, models, the stream)
    "nbl_gguf.llamacpp": 0,
    "nbl_gguf.calibration": 1,
    "nbl_gguf.gguf": 2,
    "nbl_gguf.fixtures": 3,
    "nbl_gguf.measurement": 4,
    "nbl_gguf.commands": 5,  # each command drives several stages: it is above all of them
    "nbl_gguf.cli": 6,
    "nbl_gguf.__main__": 7,
}
STAGES = ("nbl_gguf.calibration", "nbl_gguf.gguf", "nbl_gguf.fixtures", "nbl_gguf.measurement", "nbl_gguf.llamacpp")


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package's name for its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement (or __import__ / importlib.import_module of a
    constant) in ``tree`` asks for, relative imports resolved; ``from X import y`` gives X and X.y."""
    package = name if is_package else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in ("__import__", "import_module"):
                names.add(node.args[0].value)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (each name resolved to its longest module prefix)."""
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imported_names(ast.parse(path.read_text(encoding="utf-8")), name,
                                      path.name == "__init__.py"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, stack)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def rank(module: str) -> int | None:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in RANKS:
            return RANKS[prefix]
    return None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, deps in sorted(graph.items()):
        for dst in sorted(deps):
            if rank(dst) > rank(src):
                out.append(f"{src} (rank {rank(src)}) imports {dst} (rank {rank(dst)})")
    return out


# --- the checker itself ------------------------------------------------------------------------------

def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert layer_violations({"nbl_gguf.gguf.x": {"nbl_gguf.measurement.y"}}) == [
        "nbl_gguf.gguf.x (rank 2) imports nbl_gguf.measurement.y (rank 4)"]


def test_graph_sees_lazy_relative_and_dynamic_imports(tmp_path):
    root = tmp_path / PACKAGE
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "a.py").write_text("def f():\n    from nbl_gguf.b import thing\n")
    (root / "sub" / "c.py").write_text("from . import a\nfrom .. import b\n")
    (root / "b.py").write_text("import importlib\n\ndef g():\n    return importlib.import_module('nbl_gguf.sub.c')\n")
    graph = import_graph(module_files(root))
    assert graph["nbl_gguf.sub.a"] == {"nbl_gguf.b"}
    assert graph["nbl_gguf.sub.c"] == {"nbl_gguf", "nbl_gguf.sub", "nbl_gguf.sub.a", "nbl_gguf.b"}
    assert graph["nbl_gguf.b"] == {"nbl_gguf.sub.c"}
    assert find_cycle(graph) == ["nbl_gguf.b", "nbl_gguf.sub.c", "nbl_gguf.b"]


# --- the package -------------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    assert [m for m in module_files(ROOT) if rank(m) is None] == []


def test_no_import_cycles():
    cycle = find_cycle(import_graph(module_files(ROOT)))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_pipeline():
    assert layer_violations(import_graph(module_files(ROOT))) == []


def test_llamacpp_runtime_imports_only_errors():
    graph = import_graph(module_files(ROOT))
    for module, deps in graph.items():
        if module.startswith("nbl_gguf.llamacpp"):
            assert {d for d in deps if not d.startswith("nbl_gguf.llamacpp")} - {"nbl_gguf.errors"} == set(), module


def test_nothing_but_main_imports_the_cli():
    graph = import_graph(module_files(ROOT))
    assert [m for m, deps in graph.items() if "nbl_gguf.cli" in deps] == ["nbl_gguf.__main__"]


def test_no_stage_imports_a_command():
    graph = import_graph(module_files(ROOT))
    offenders = {module: sorted(d for d in deps if d.startswith("nbl_gguf.commands"))
                 for module, deps in graph.items() if not module.startswith(("nbl_gguf.commands", "nbl_gguf.cli",
                                                                              "nbl_gguf.__main__"))}
    assert {module: deps for module, deps in offenders.items() if deps} == {}
    assert any(module.startswith(STAGES) for module in graph)  # the check saw the stages


def test_the_cli_reaches_the_commands_only():
    """cli.py imports nothing of the package but errors, and every command it names is a module of
    nbl_gguf.commands with add_arguments and run; every command module there with a run is named."""
    import importlib

    from nbl_gguf.cli import COMMANDS

    graph = import_graph(module_files(ROOT))
    assert graph["nbl_gguf.cli"] <= {"nbl_gguf.errors"}
    modules = {module for module, _ in COMMANDS.values()}
    assert all(module.startswith("nbl_gguf.commands.") for module in modules), modules
    for module in modules:
        loaded = importlib.import_module(module)
        assert callable(loaded.add_arguments) and callable(loaded.run), module
    with_run = {m for m, path in module_files(ROOT).items() if m.startswith("nbl_gguf.commands.")
                and any(line.startswith("def run(") for line in path.read_text(encoding="utf-8").splitlines())}
    assert with_run == modules


def test_only_the_commands_parse_arguments():
    """argparse is the commands' (and the CLI's): a stage takes typed settings or plain parameters, never
    an argparse namespace, so no stage imports argparse or names a parameter ``args`` unless it is a
    list of command-line words (annotated) or ``*args``."""
    offenders = []
    for module, path in module_files(ROOT).items():
        if not module.startswith(STAGES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if "argparse" in _imported_names(tree, module, path.name == "__init__.py"):
            offenders.append(f"{module} imports argparse")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    if arg.arg == "args" and arg.annotation is None:
                        offenders.append(f"{module}.{node.name} takes an untyped args")
    assert offenders == []
