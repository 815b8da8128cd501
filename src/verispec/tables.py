"""The one table printer: rows of strings as aligned plain text or as a markdown table."""

from __future__ import annotations


def text_table(head: list[str], rows: list[list[str]]) -> str:
    """Columns left-aligned to their widest cell, a dashed rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table; `|` inside cells is escaped."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)
