"""The import direction of docs/design.md, section 'Layering', checked on the source files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"
ROOTS = [SRC, SRC.parents[1] / "benchmarks", SRC.parents[1] / "scripts"]


def verispec_imports(path: Path) -> set[str]:
    """Modules of verispec imported anywhere in a file (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verispec"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("verispec"))
    return found


def test_probability_layer_imports_nothing_from_verispec():
    assert verispec_imports(SRC / "probability.py") == set()
    assert verispec_imports(SRC / "spec.py") == set()
    assert verispec_imports(SRC / "ray_cluster.py") == set()  # shared by the sweep executor and serve


def test_rules_never_import_diagnostics_models_or_decode():
    for path in [*(SRC / "rules").glob("*.py"), *(SRC / "trees").glob("*.py")]:  # trees: the rules' layer
        bad = {m for m in verispec_imports(path)
               if m.split(".")[1] in ("diagnostics", "models", "decode", "sampling", "evaluation", "api",
                                      "cli")}
        assert not bad, f"{path.name} imports {bad}"
    for path in (SRC / "rules").glob("*.py"):  # trees build on rules, never the reverse
        assert not {m for m in verispec_imports(path) if m.startswith("verispec.trees")}, path.name
    assert {m.split(".")[1] for m in verispec_imports(SRC / "gates.py")} <= {"probability"}


def test_diagnostics_import_only_rules_and_below():
    for path in (SRC / "diagnostics").glob("*.py"):
        layers = {m.split(".")[1] for m in verispec_imports(path) if "." in m}
        assert layers <= {"probability", "rules", "diagnostics", "gates", "spec"}, f"{path.name}: {layers}"


PRIVATE = re.compile(r"\.(_accept|_accept_at|_residual|_residual_after|_emitted|_bonus|_baseline|_verify)\(")


def test_nothing_outside_rules_calls_a_rules_private_method():
    offenders = []
    for root in ROOTS:
        for path in root.rglob("*.py"):
            if path.parent == SRC / "rules":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line):
                    offenders.append(f"{path.relative_to(SRC.parents[1])}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_check_can_fail(tmp_path):
    """The detectors find a violation when there is one (a test that cannot fail checks nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from verispec.diagnostics import tv\n\ndef f(rule, p):\n    return rule._bonus(p)\n")
    assert verispec_imports(bad) == {"verispec.diagnostics"}
    assert PRIVATE.search(bad.read_text().splitlines()[3])
