"""The wheel holds the library and nothing else (issue 31): built as a user's `pip` builds it,
then listed. The test and benchmark models live in `mlx_spec.testing`, which pyproject.toml
leaves out, so no module that ships may import it, and every module that ships is one the
program can import: reachable from the `mlx-spec` entry point through import statements."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_only_the_library(tmp_path):
    # from a copy of the sources: pip builds in place, and a checkout's build/ may hold stale files
    source = tmp_path / "source"
    shutil.copytree(ROOT / "mlx_spec", source / "mlx_spec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("mlx_spec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if not n.startswith("mlx_spec-")}  # less the .dist-info
    assert shipped and all(n.startswith("mlx_spec/") for n in shipped), sorted(shipped)
    assert not [n for n in shipped if n.startswith("mlx_spec/testing/")]
    # the data the library reads at run time
    assert "mlx_spec/loading/presets/presets.toml" in shipped
    assert any(n.startswith("mlx_spec/prompts/") and n.endswith(".txt") for n in shipped)
    # every library module in the checkout is in the wheel, so nothing else was left out
    library = {str(p.relative_to(ROOT)) for p in (ROOT / "mlx_spec").rglob("*.py")
               if "testing" not in p.relative_to(ROOT).parts}
    assert library <= shipped, sorted(library - shipped)
    modules = {n for n in shipped if n.endswith(".py")}
    entry_points = ("mlx_spec.cli", "mlx_spec.cli.__main__")  # `mlx-spec`, `python -m mlx_spec.cli`
    assert modules - set().union(*map(reachable_from, entry_points)) == set()


def _module_file(name: str) -> Path | None:
    path = ROOT / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(name: str, path: Path) -> set[str]:
    """The mlx_spec modules a module's import statements name (inside functions too), and
    what a package's lazy `_EXPORTS` table resolves to."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level − 1
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            found |= {f"{package}.{module}" for module in ast.literal_eval(node.value).values()}
    # importing a.b.c runs a/__init__ and a/b/__init__ too
    return {".".join(n.split(".")[:i]) for n in found if n.startswith("mlx_spec") for i in range(1, n.count(".") + 2)}


def reachable_from(root: str) -> set[str]:
    """Wheel paths of every module the import statements reach from `root`."""
    seen, todo = {}, [root]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = str(path.relative_to(ROOT))
        todo.extend(_imported(name, path))
    return set(seen.values())


def test_no_shipped_module_imports_the_testing_package():
    for path in (ROOT / "mlx_spec").rglob("*.py"):
        if "testing" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.startswith("mlx_spec.testing") for n in names), (path, names)


def test_no_two_modules_import_each_other():
    # import statements inside functions count too: a lazy import can hide a circle, not undo it
    modules = {}
    for path in (ROOT / "mlx_spec").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: {other for other in _imported(name, path)
                    if other in modules and other != name and not name.startswith(other + ".")}  # its own packages
             for name, path in modules.items()}
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (a deep import chain must not hit the recursion limit)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt), on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
    return components
