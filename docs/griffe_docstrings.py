"""A griffe extension for the API reference: the docstrings as a reader of ``help()`` sees them, in Markdown.

- The DP callbacks' docstrings hold a ``{shared}`` placeholder that
  ``lightning_oso.callbacks._docs._document_shared_args`` fills when the class is defined (one text, every
  callback). griffe reads the source without importing it, so it would see the placeholder; it is filled here the
  same way, from the same text.
- Sphinx roles (``:class:`~lightning_oso.PrivacyAccountant```) mean nothing to Markdown; they become inline code
  (``PrivacyAccountant``: a ``~`` keeps the last name, as in Sphinx).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator

import griffe

PLACEHOLDER = "{shared}"
SHARED_ARGS = "callbacks._docs._SHARED_ARGS_DOC"  # inside the lightning_oso package
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


class LightningOsoDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.name != "lightning_oso":
            return
        for obj in _objects(pkg):
            if obj.docstring is not None:
                text = _fill_shared(obj.docstring.value, pkg)
                obj.docstring.value = SPHINX_ROLE.sub(_inline_code, text)


def _fill_shared(doc: str, pkg: griffe.Module) -> str:
    if PLACEHOLDER not in doc:
        return doc
    try:
        shared = ast.literal_eval(str(pkg.get_member(SHARED_ARGS).value))
    except (KeyError, ValueError, SyntaxError) as err:
        raise RuntimeError(
            f"a docstring holds {PLACEHOLDER} but lightning_oso.{SHARED_ARGS} is no string constant: "
            "point SHARED_ARGS in docs/griffe_docstrings.py at the shared arguments' text"
        ) from err
    first, *rest = shared.splitlines()
    body = textwrap.dedent("\n".join(rest))  # in the source, the text is indented for a class docstring's "Args:"
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == PLACEHOLDER:
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = indent + first + "\n" + textwrap.indent(body, indent)
    return "\n".join(lines)


def _inline_code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):  # not an alias: the target is documented where it is defined
            yield from _objects(member)
