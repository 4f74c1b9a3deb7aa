"""The package's metadata as an index reads it (pyproject.toml): classifiers an index accepts, an SPDX licence, a
Python range that agrees with the classifiers, and dependencies the library uses. ``make package`` checks the built
wheel and sdist themselves (``twine check --strict``)."""

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_classifier_is_one_an_index_accepts():
    trove_classifiers = pytest.importorskip("trove_classifiers")  # the dev extra installs it
    unknown = [c for c in PROJECT["classifiers"] if c not in trove_classifiers.classifiers]
    assert not unknown, f"not in trove-classifiers, so an upload would be refused: {unknown}"


def test_licence_is_an_spdx_expression_with_its_file():
    assert PROJECT["license"] == "MIT"
    assert all((ROOT / name).is_file() for name in PROJECT["license-files"])
    # PEP 639: a licence expression replaces the licence classifiers
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]


def test_python_versions_agree():
    minimum = re.fullmatch(r">=(3\.\d+)", PROJECT["requires-python"]).group(1)
    versions = [c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)]
    assert versions and min(versions, key=lambda v: int(v.split(".")[1])) == minimum
    assert "Typing :: Typed" in PROJECT["classifiers"] and (ROOT / "lightning_oso" / "py.typed").is_file()


def _imported_top_level_modules(package: Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_runtime_dependencies_are_used_and_opacus_is_capped():
    """A runtime dependency the library never imports belongs in the extra that needs it (tensorboard is the
    exception: Lightning's default logger, which the callbacks' ``dp/*`` metrics go to); opacus' internals are used,
    so its next major version is excluded."""
    imported = _imported_top_level_modules(ROOT / "lightning_oso")
    requirements = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]: r for r in PROJECT["dependencies"]}
    module_of = {"typing_extensions": "typing_extensions", "lightning": "lightning", "tensorboard": None}
    for name in requirements:
        module = module_of.get(name, name)
        assert module is None or module in imported, f"{name} is a runtime dependency the library never imports"
    assert "torchmetrics" not in requirements and "torchmetrics" not in imported
    assert re.search(r"<\s*2\b", requirements["opacus"]), requirements["opacus"]
