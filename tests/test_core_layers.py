"""The C++ core's folders are its layers (docs/architecture.md, section 1):
every file of moolib/core/ sits in a folder, and includes only what its
folder's row of the table allows. Read from the sources, so it needs no build.
"""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "moolib" / "core"

# The layers, lowest first: a file includes from its own folder and those
# below it (docs/architecture.md, section 1).
LAYERS = ["runtime", "shm", "transport", "rpc", "collectives"]
ALLOWED: dict[str, set[str]] = {layer: set(LAYERS[:i]) for i, layer in enumerate(LAYERS)}
# The frames a transport carries are the RPC protocol's: of rpc/, only wire.h
# is below it.
ALLOWED["transport"].add("rpc/wire.h")
# The replay table stands on the runtime alone, and the binding binds them all.
ALLOWED["replay"] = {"runtime"}
ALLOWED["python"] = {*LAYERS, "replay"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for p in CORE.rglob("*") if p.suffix in (".h", ".cc"))


def _allows(folder: str, included: str) -> bool:
    """Whether a file of ``folder`` may include ``included`` (a path from the core)."""
    top = included.split("/", 1)[0]
    return top == folder or top in ALLOWED[folder] or included in ALLOWED[folder]


def test_every_core_file_is_in_a_layer_folder() -> None:
    stray = [
        str(p.relative_to(CORE)) for p in _sources() if p.relative_to(CORE).parts[0] not in ALLOWED
    ]
    assert not stray, f"files of moolib/core/ outside its layer folders: {stray}"


def test_every_include_names_a_core_file_from_the_core_root() -> None:
    missing = [
        f"{p.relative_to(CORE)}: {name}"
        for p in _sources()
        for name in INCLUDE.findall(p.read_text())
        if not (CORE / name).is_file()
    ]
    assert not missing, f"includes that are not paths from moolib/core/: {missing}"


def test_each_layer_includes_only_what_its_row_allows() -> None:
    broken = []
    for p in _sources():
        folder = p.relative_to(CORE).parts[0]
        if folder not in ALLOWED:
            continue
        for name in INCLUDE.findall(p.read_text()):
            if not _allows(folder, name):
                broken.append(f"{p.relative_to(CORE)} includes {name}")
    assert not broken, (
        "includes across the core's layers (docs/architecture.md, section 1): " + "; ".join(broken)
    )
