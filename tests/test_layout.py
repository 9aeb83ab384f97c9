"""The layout's rules (ARCHITECTURE.md), read off the source: no file over 400 lines (but the generated
bench_results/), no import circle (imports inside functions counted too: a circle closed lazily is still
a circle), no import between the modules of data/ or losses/ hidden in a function, the library never
importing the trainer or accelerate, and no document pointing outside the repository."""

from __future__ import annotations

import ast
import subprocess

from conftest import ROOT

PACKAGES = ("mmpretrain", "data_tools")
LIBRARY = ("mmpretrain.losses", "mmpretrain.models", "mmpretrain.data", "mmpretrain.eval", "mmpretrain.config",
           "mmpretrain.run_files")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def _imports(name: str, tree: ast.Module, known: set[str]) -> tuple[set[str], set[str]]:
    """(module-level, inside functions) imports of known modules and of accelerate; ``from pkg import
    sub`` counts as an import of the submodule ``pkg.sub``."""
    top_nodes = {id(n) for n in tree.body}
    top, inner = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found = {n for n in names if (n in known or n.split(".")[0] == "accelerate") and n != name}
        (top if id(node) in top_nodes else inner).update(found)
    return top, inner


def test_no_file_over_400_lines():
    """Every tracked text file -- the package, the tools, the tests, scripts/, docs/, configs -- but the
    generated results under bench_results/ (JSON written by the benchmarks and the experiment grid)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    text = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json"}
    long = {}
    for name in tracked:
        path = ROOT / name
        if name.startswith("bench_results/") or path.suffix not in text and path.name != "Makefile":
            continue
        if (n := len(path.read_text().splitlines())) > 400:
            long[name] = n
    assert not long, long
    # and the package's modules, also in a tree that is not a git checkout
    modules = {str(p.relative_to(ROOT)): n for package in PACKAGES for p in (ROOT / package).rglob("*.py")
               if (n := len(p.read_text().splitlines())) > 400}
    assert not modules, modules


def test_no_import_circle_and_the_library_never_imports_the_trainer():
    mods = _modules()
    known = set(mods)
    graph, lazy = {}, {}
    for name, tree in mods.items():
        graph[name], lazy[name] = _imports(name, tree, known)
    seen, path, circles = {}, [], []

    def visit(m):
        seen[m] = 1
        path.append(m)
        for dep in (graph[m] | lazy[m]) & known:
            if seen.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in seen:
                visit(dep)
        path.pop()
        seen[m] = 2

    for m in mods:
        if m not in seen:
            visit(m)
    assert not circles, circles
    for package in ("mmpretrain.data", "mmpretrain.losses"):
        hidden = {m: sorted(d for d in lazy[m] if d.startswith(package)) for m in mods if m.startswith(package)}
        assert not any(hidden.values()), {m: d for m, d in hidden.items() if d}
    # the config package is a leaf: its modules import only each other, and only config.outside reaches
    # the rest of the package, lazily (the registries it checks names against)
    for m in mods:
        if m.startswith("mmpretrain.config"):
            outside = sorted(d for d in graph[m] | (lazy[m] if m != "mmpretrain.config.outside" else set())
                             if d.startswith("mmpretrain") and not d.startswith("mmpretrain.config"))
            assert not outside, (m, outside)
    for m in mods:
        if m.startswith(LIBRARY) and m != "mmpretrain.process":
            bad = sorted(d for d in graph[m] | lazy[m] if d.startswith(("mmpretrain.train", "accelerate")))
            assert not bad, (m, bad)


def test_no_document_points_outside_the_repository():
    outside = "shared" + "/docs"  # spelled in two parts, so that this file does not match its own search
    tracked = subprocess.run(["git", "grep", "-l", outside], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked.splitlines() == []
