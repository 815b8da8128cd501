"""The `verispec` command line."""

from __future__ import annotations

import argparse
import sys


def catalogue_rows() -> list[dict[str, str]]:
    from verispec.rules import names, rule_class

    return [rule_class(n).describe() for n in names()]


def markdown_table(rows: list[dict[str, str]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def text_table(rows: list[dict[str, str]], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    out = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(r[c].ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(out)


def cmd_rules(args: argparse.Namespace) -> int:
    rows = catalogue_rows()
    if args.markdown:
        print(markdown_table(rows))
    else:
        print(text_table(rows, ["rule", "family", "lossless", "parameters", "source"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rules = sub.add_parser("rules", help="print the catalogue of verification rules")
    rules.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    rules.set_defaults(func=cmd_rules)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
