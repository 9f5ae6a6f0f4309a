"""docs/architecture.md's layout names every module of the three packages, so a module added or
moved without its line there fails here (docs/architecture.md: "every module in its layout")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def section(start: str, end: str) -> str:
    return DOC[DOC.index(start):DOC.index(end)]


#: The core and client layout, and the service's.
LAYOUT = section("## Layout", "### The service")
SERVICE = section("### The service", "### One observation")


def modules(package: str) -> list[Path]:
    return sorted(path.relative_to(ROOT) for path in (ROOT / package).rglob("*.py")
                  if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts)


def listed(path: Path) -> bool:
    """Whether the layout names ``path``: by its path, or by its name in the block of its folder."""
    relative, name, stem = path.as_posix(), path.name, path.stem
    package = path.parts[0]
    if package == "pasto":
        return relative in LAYOUT
    if package == "pasto_client":
        block = LAYOUT[LAYOUT.index("pasto_client/"):LAYOUT.index("service/cli.py")]
        return re.search(rf"^\s+{re.escape(name)}\s", block, re.MULTILINE) is not None
    folder = "/".join(path.parts[:-1]) + "/"
    if folder == "service/":
        return relative in SERVICE or re.search(rf"(^|[ ,]){re.escape(name)}\b", SERVICE, re.MULTILINE) is not None
    if folder not in SERVICE:
        return False
    block = SERVICE[SERVICE.index(folder):]
    following = re.search(r"\n(service/|```)", block[len(folder):])  # the next folder or the block's end
    block = block[:len(folder) + following.start()]
    return re.search(rf"\b{re.escape(stem)}\b", block) is not None


@pytest.mark.parametrize("path", [*modules("pasto"), *modules("pasto_client"), *modules("service")],
                         ids=lambda path: path.as_posix())
def test_every_module_is_in_the_layout(path):
    assert listed(path), f"docs/architecture.md's layout does not name {path.as_posix()}"


def test_the_check_can_fail():
    assert not listed(Path("service/controller/planted.py"))
    assert not listed(Path("pasto/planted.py"))
    assert not listed(Path("service/planted.py"))
    assert not listed(Path("pasto_client/planted.py"))
