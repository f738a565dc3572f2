"""Read the package's reST-flavoured docstrings as Markdown for the API reference.

The docstrings are written for ``help()`` and Sphinx habits (``:class:`X```, ``Example::`` and an
indented literal block, a simple ``====`` table); this griffe extension rewrites them before
mkdocstrings parses them as Google-style docstrings: roles become code (a link where the target is
documented), ``Example::`` becomes an Examples section holding a Python block, any other ``::``
block a fenced block, a simple table a literal block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
TABLE_RULE = re.compile(r"^\s*=+( +=+)+\s*$")
EXAMPLE = re.compile(r"^(\s*)Examples?::\s*$")


def _role(found: re.Match[str]) -> str:
    target = found[2].lstrip(".")
    shown = target.rsplit(".", 1)[-1] if found[1] else target
    if target.startswith("lockstep."):  # a link when the reference documents it, code otherwise
        return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'
    return f"`{shown}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_blocks(lines: list[str]) -> list[str]:
    """Each ``::`` paragraph's indented block becomes a fenced one (``Example::``: a section)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::") or line.strip().startswith(".."):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        body = lines[i + 1 : end]
        while body and not body[0].strip():
            body.pop(0)
        while body and not body[-1].strip():
            body.pop()
        code = [text for text in body if text.strip()]
        if not code:
            out.append(line.rstrip()[:-1])
            i += 1
            continue
        inner = min(_indent(text) for text in code)
        if example := EXAMPLE.match(line):
            out.append(f"{example[1]}Examples:")
        else:
            out += [line.rstrip()[:-1], ""]
        fence = " " * inner + "```"
        out += [fence + "python", *(text if text.strip() else "" for text in body), fence, ""]
        i = end
    return out


def _tables(lines: list[str]) -> list[str]:
    """A simple reST table (three ``====`` rules) is shown as it is written."""
    out: list[str] = []
    rules = 0
    for line in lines:
        if TABLE_RULE.match(line):
            rules += 1
            if rules == 1:
                out += ["", " " * _indent(line) + "```text"]
            out.append(line)
            if rules == 3:
                out += [" " * _indent(line) + "```", ""]
                rules = 0
            continue
        out.append(line)
    return out


def markdown(text: str) -> str:
    """The docstring ``text`` with its reST habits written as Markdown."""
    lines = _tables(ROLE.sub(_role, text).splitlines())
    return "\n".join(_literal_blocks(lines))


class RstDocstrings(griffe.Extension):
    """Rewrite every loaded object's docstring before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
