"""The import graph points one way (the layers in specjax/__init__.py's docstring) and has no
cycles: a reader can take the package from the bottom up, and a lower layer never needs a higher
one to be importable."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ("bridge",),
    ("specjax", "specjax.paths", "specjax.placement", "specjax.processes", "specjax.hub"),
    ("specjax.kernels",),
    ("specjax.models",),
    ("specjax.sharding",),
    ("specjax.decode",),
    ("specjax.train",),
    ("specjax.plan",),
    ("specjax.commands", "specjax.cli"),
]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted([*ROOT.glob("bridge/**/*.py"), *ROOT.glob("specjax/**/*.py")]):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def rank(mod: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and (best is None or len(pre) > best[1]):
                best = (i, len(pre))
    assert best is not None, f"{mod} is in no layer; add it to LAYERS and to specjax/__init__.py's docstring"
    return best[0]


def edges(mods: dict[str, Path]):
    """(importer, imported module, line) for every project import, at module level or in a function."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                if n.split(".")[0] in ("bridge", "specjax"):
                    t = resolve(n)
                    if t and t != m:
                        yield m, t, node.lineno


def test_imports_point_down_the_layers():
    mods = modules()
    up = [f"{m}:{line} imports {t} (layer {rank(t)} > {rank(m)})" for m, t, line in edges(mods) if rank(t) > rank(m)]
    assert not up, "\n".join(up)


def test_no_import_cycles():
    mods = modules()
    graph = {m: set() for m in mods}
    for m, t, _ in edges(mods):
        graph[m].add(t)
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_rank_table_is_the_documented_order():
    """models < decode < train, bridge at the bottom, the CLI at the top."""
    assert rank("specjax.models.layers") < rank("specjax.decode.generate") < rank("specjax.train.trainer")
    assert rank("bridge.schema") == 0 and rank("specjax.processes") == 1 and rank("specjax.cli") == 8


def test_no_private_names_cross_modules():
    """A name with a leading underscore is its module's own: no other module imports it."""
    bad = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("specjax", "bridge"):
                bad += [f"{mod}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)
