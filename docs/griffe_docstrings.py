"""A griffe extension for the API reference: the docstrings as a reader of ``help()`` sees them, in Markdown.

- The DP callbacks' docstrings hold a ``{shared}`` placeholder that
  ``lightning_oso.callbacks.arguments._document_shared_args`` fills when the class is defined (one text per
  argument, each callback the arguments it takes). griffe reads the source without importing it, so it would see
  the placeholder; here such a docstring is replaced by the class's own ``__doc__`` after import, the text
  ``help()`` shows.
- Sphinx roles (``:class:`~lightning_oso.PrivacyAccountant```) mean nothing to Markdown; they become inline code
  (``PrivacyAccountant``: a ``~`` keeps the last name, as in Sphinx).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator

import griffe

PLACEHOLDER = "{shared}"
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


class LightningOsoDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.name != "lightning_oso":
            return
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = SPHINX_ROLE.sub(_inline_code, _fill_shared(obj))


def _fill_shared(obj: griffe.Object) -> str:
    doc = obj.docstring.value if obj.docstring is not None else ""
    if not obj.is_class or PLACEHOLDER not in doc:  # only the callbacks' class docstrings are filled
        return doc
    module, _, name = obj.path.rpartition(".")
    runtime = inspect.getdoc(getattr(importlib.import_module(module), name))
    if runtime is None or PLACEHOLDER in runtime:
        raise RuntimeError(f"{obj.path}'s docstring holds {PLACEHOLDER}, but its runtime __doc__ does not fill it")
    return runtime


def _inline_code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if isinstance(member, griffe.Object):  # not an alias: the target is documented where it is defined
            yield from _objects(member)
