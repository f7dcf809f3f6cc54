"""One home per algorithm: no module outside an algorithm's own files compares algorithm names.

What the rest of the code needs to know about an algorithm is an attribute or method of its draft
class (``specjax/models/drafts/<name>.py``, found through ``registry.py``) or of its training
adapter (``specjax/train/algorithms/<name>.py``). A comparison such as ``algo == "mtp"`` or
``algo in ("dflash", "dspark")`` anywhere else is the scattering this test keeps out."""

import ast
from pathlib import Path

from specjax.train.algorithms import SPECULATOR_TYPES

ROOT = Path(__file__).resolve().parents[1]
HOMES = {f"specjax/models/drafts/{n}.py" for n in SPECULATOR_TYPES} | {"specjax/models/drafts/registry.py"}
HOME_DIRS = ("specjax/train/algorithms/",)


def _names(node) -> set[str]:
    """Algorithm names a comparison operand spells out (a string, or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(SPECULATOR_TYPES)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def name_comparisons(source: str) -> list[tuple[int, set[str]]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found = set().union(*(_names(x) for x in [node.left, *node.comparators]))
            if found:
                out.append((node.lineno, found))
    return out


def test_the_scan_finds_comparisons():
    src = 'if algo == "mtp": pass\nif a in ("dflash", "dspark"): pass\nx = {"eagle3": 1}\nif "x" == y: pass\n'
    assert name_comparisons(src) == [(1, {"mtp"}), (2, {"dflash", "dspark"})]


def test_no_algorithm_name_comparisons_outside_their_homes():
    bad = []
    for p in sorted([*ROOT.glob("specjax/**/*.py"), *ROOT.glob("bridge/**/*.py")]):
        rel = p.relative_to(ROOT).as_posix()
        if rel in HOMES or rel.startswith(HOME_DIRS):
            continue
        bad += [f"{rel}:{line} compares {sorted(names)}" for line, names in name_comparisons(p.read_text())]
    assert not bad, "algorithm knowledge belongs to the draft class or the training adapter:\n" + "\n".join(bad)
