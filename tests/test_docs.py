"""The documentation holds together: the README stays short, every local link in the README and docs/
resolves (a file, and a heading for an anchor), and every citation of a section (a docs/<name>.md file or
the README, benchmarks/RESULTS.md or study/NOTEBOOK.md, a comma, then the section's name in quotes) in the
code, tests, scripts, the study's scripts and docs names a heading (or a bold paragraph lead) of that file.
The two notebooks themselves, dated, cite sections as they were and are not checked."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
# "docs/design/rules.md, 'Token roles'" or "..., section 'Token roles'" (the title may wrap a line)
CITATION = re.compile(r"(docs/[\w./-]+\.md|README(?:\.md)?|benchmarks/RESULTS\.md|study/NOTEBOOK\.md)`?,\s+"
                      r"(?:section\s+)?(['\"])(\S[^'\"]*?)\2")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    in_code, out = False, []
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6} (.*)$", line)):
            out.append(m.group(1).strip())
    return out


def leads(path: Path) -> list[str]:
    """Bold paragraph leads (`**Look 1 (...)**`), cited like headings."""
    return [m.group(1) for m in re.finditer(r"\*\*([^*]+)\*\*", path.read_text(encoding="utf-8"))]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 350, len(lines)


def test_every_local_link_resolves():
    broken = []
    for doc in [ROOT / "README.md", *DOCS]:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in {slug(h) for h in headings(path)}:
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_section_citation_resolves():
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
               *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "scripts").glob("*"), ROOT / "README.md", *DOCS,
               *(ROOT / "study").glob("*.py"), *(ROOT / "study" / "tests").glob("*.py"),
               ROOT / "study" / "README.md",
               ROOT / "pyproject.toml"]
    unresolved, seen = [], 0
    for source in sources:
        if not source.is_file() or source.suffix not in (".py", ".md", ".toml", ""):
            continue
        for file, _, section in CITATION.findall(source.read_text(encoding="utf-8", errors="replace")):
            seen += 1
            target = ROOT / ("README.md" if file.startswith("README") else file)
            name = " ".join(section.split()).replace("...", "").strip().rstrip(".,:")
            if not target.exists():
                unresolved.append(f"{source.relative_to(ROOT)}: {file} does not exist")
                continue
            known = [" ".join(h.split()) for h in headings(target) + leads(target)]
            if not any(k.startswith(name) or name.startswith(k) for k in known if k):
                unresolved.append(f"{source.relative_to(ROOT)}: {file}, '{name}'")
    assert seen > 20  # the check reads the citations (the code cites docs/design.md throughout)
    assert not unresolved, unresolved


def test_the_benchmarks_readme_lists_every_script():
    """benchmarks/README.md names each script (kernel and profiling ones under kernels/) with what it
    measures; a script added without a line there is caught here."""
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p.relative_to(ROOT / "benchmarks").as_posix() for p in (ROOT / "benchmarks").rglob("*.py")
               if p.name != "common.py" and "sweeps" not in p.parts]
    assert scripts and not [s for s in scripts if f"`{s}`" not in readme]


def test_the_study_readme_lists_every_script():
    """study/README.md names each analysis script of the study (fresh.py, their shared helper, aside)."""
    readme = (ROOT / "study" / "README.md").read_text()
    scripts = [p.name for p in (ROOT / "study").glob("*.py") if p.name != "fresh.py"]
    assert scripts and not [s for s in scripts if f"`{s}`" not in readme]
