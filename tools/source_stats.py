"""Count a Python tree's lines by kind: code, docstrings, comments, blank.

    python tools/source_stats.py [PATH ...] [--top N] [--max-docstring-share 0.25]

Prints the totals and the docstring share (docstring lines over all lines), then the N modules with
the most code lines. ``--max-docstring-share`` exits 1 when the share is above it. The module guide
(STYLE.md, tests/lockstep/test_layout.py) counts code lines only: docstrings and comments do not make
a module large.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Lines:
    """Line counts of one file or a tree; a line holding code and a comment counts as code."""

    code: int = 0
    docstring: int = 0
    comment: int = 0
    blank: int = 0

    @property
    def total(self) -> int:
        return self.code + self.docstring + self.comment + self.blank

    def __add__(self, other: Lines) -> Lines:
        return Lines(*(a + b for a, b in zip(vars(self).values(), vars(other).values(), strict=True)))


def _docstring_lines(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return out


def count(source: str) -> Lines:
    """The line counts of one module's source."""
    docs = _docstring_lines(ast.parse(source))
    code: set[int] = set()
    comments: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    code -= docs
    lines = source.splitlines()
    blank = sum(1 for i, text in enumerate(lines, 1) if not text.strip() and i not in docs and i not in code)
    return Lines(len(code), len(docs), len(comments - code - docs), blank)


def walk(paths: list[Path]) -> dict[Path, Lines]:
    """Counts per ``.py`` file under ``paths``."""
    files = [f for p in paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])]
    return {f: count(f.read_text()) for f in files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1] / "src"])
    parser.add_argument("--top", type=int, default=10, help="list the N modules with the most code lines")
    parser.add_argument("--max-docstring-share", type=float, default=None, help="exit 1 above this share (0-1)")
    args = parser.parse_args(argv)
    per_file = walk(args.paths)
    total = sum(per_file.values(), Lines())
    share = total.docstring / max(total.total, 1)
    print(
        f"{len(per_file)} files, {total.total} lines: code {total.code}, docstrings {total.docstring}, "
        f"comments {total.comment}, blank {total.blank}; docstring share {share:.1%}"
    )
    for path, lines in sorted(per_file.items(), key=lambda kv: -kv[1].code)[: args.top]:
        print(f"  {lines.code:5d} code lines  {path}")
    if args.max_docstring_share is not None and share > args.max_docstring_share:
        print(f"docstring share {share:.1%} is above {args.max_docstring_share:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
