"""moolib/_core.pyi, the type stub of the core, against the built moolib._core:
every name the stub declares exists, of the kind it says (class, function,
attribute), with the parameters it says, and the module has nothing the stub
leaves out. A change to the binding that the stub does not follow fails here."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from moolib import _core

STUB = Path(_core.__file__).parent / "_core.pyi"

# Attributes every pybind11 class or module has, which no stub declares.
IMPLICIT = {"_pybind11_conduit_v1_"}


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _declared(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Name -> declaration (def, class or annotated attribute) of a stub body."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _stub_params(node: ast.FunctionDef) -> list[tuple[str, str, bool]]:
    """(name, kind, has a default) of each parameter, self and cls left out."""
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    params = [(p.arg, "positional", d) for p, d in zip(positional, defaults, strict=True)]
    if a.vararg:
        params.append((a.vararg.arg, "*", False))
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append((p.arg, "keyword", d is not None))
    if a.kwarg:
        params.append((a.kwarg.arg, "**", False))
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    if params and not is_static and params[0][0] in ("self", "cls"):
        params = params[1:]
    return params


def _split_top_level(text: str) -> list[str]:
    """text split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p.strip() for p in parts]


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.KEYWORD_ONLY: "keyword",
    inspect.Parameter.VAR_KEYWORD: "**",
}


def _runtime_params(name: str, obj: object) -> list[tuple[str, str, bool]] | None:
    """The parameters of a function of the module as the stub writes them, or
    None where the runtime does not say (a slot wrapper, say)."""
    try:
        sig = inspect.signature(obj)  # CPython functions with a text signature
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = [
            (p.name, _KINDS[p.kind], p.default is not inspect.Parameter.empty)
            for p in sig.parameters.values()
        ]
        if params and params[0][0] in ("self", "$self"):
            params = params[1:]
        return params
    # pybind11 writes the signature as the docstring's first line:
    # "name(self: moolib._core.Rpc, arg0: str, timeout: float = 10.0) -> str".
    doc = getattr(obj, "__doc__", None) or ""
    match = re.match(rf"{re.escape(name)}\((.*)\) -> ", doc.splitlines()[0] if doc else "")
    if not match:
        return None
    params = []
    for part in _split_top_level(match.group(1)):
        if part in ("*", "/"):
            continue
        pname = part.split(":")[0].strip()
        kind = "positional"
        if pname.startswith("**"):
            pname, kind = pname[2:], "**"
        elif pname.startswith("*"):
            pname, kind = pname[1:], "*"
        params.append((pname, kind, "=" in part))
    if params and params[0][0] == "self":
        params = params[1:]
    return params


def _check_signature(where: str, node: ast.FunctionDef, obj: object) -> None:
    runtime = _runtime_params(node.name, obj)
    if runtime is None:
        return
    declared = _stub_params(node)
    assert len(runtime) == len(declared), f"{where}: the stub has {declared}, the core {runtime}"
    for (dname, dkind, ddefault), (rname, rkind, rdefault) in zip(declared, runtime, strict=True):
        # pybind11 names a parameter bound without py::arg argN: only its place counts.
        if not re.fullmatch(r"arg\d+", rname):
            assert dname == rname, f"{where}: the stub has {declared}, the core {runtime}"
        assert dkind == rkind, f"{where}: the stub has {declared}, the core {runtime}"
        assert ddefault == rdefault, f"{where}: the stub has {declared}, the core {runtime}"


def _is_property(node: ast.stmt) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
    )


def _own_names(cls: type) -> set[str]:
    """The names a class of the core defines (not inherited), dunders left out
    unless the stub might declare them (__init__ and the like are checked
    from the stub's side)."""
    return {n for n in vars(cls) if not n.startswith("__") and n not in IMPLICIT}


def test_every_name_of_the_stub_is_in_the_core_and_the_other_way_round():
    declared = _declared(_stub().body)
    module = {n for n in dir(_core) if not n.startswith("__") and n not in IMPLICIT}
    assert sorted(module - set(declared)) == [], "names of moolib._core missing in _core.pyi"
    assert sorted(set(declared) - module) == [], "names of _core.pyi missing in moolib._core"


@pytest.mark.parametrize(
    "name", [n for n, d in _declared(_stub().body).items() if not isinstance(d, ast.ClassDef)]
)
def test_module_functions_match_the_stub(name):
    node = _declared(_stub().body)[name]
    obj = getattr(_core, name)
    if isinstance(node, ast.AnnAssign):
        assert not callable(obj) or isinstance(obj, type), name
        return
    assert callable(obj) and not isinstance(obj, type), f"{name} is not a function"
    _check_signature(name, node, obj)


@pytest.mark.parametrize(
    "name", [n for n, d in _declared(_stub().body).items() if isinstance(d, ast.ClassDef)]
)
def test_classes_match_the_stub(name):
    node = _declared(_stub().body)[name]
    cls = getattr(_core, name)
    assert isinstance(cls, type), f"{name} is not a class"
    members = _declared(node.body)
    assert sorted(_own_names(cls) - set(members)) == [], f"members of {name} missing in the stub"
    for member, decl in members.items():
        assert hasattr(cls, member), f"{name}.{member} of the stub is not in the core"
        obj = inspect.getattr_static(cls, member)
        if isinstance(decl, ast.AnnAssign) or _is_property(decl):
            assert not callable(obj), f"{name}.{member} is a method, the stub says an attribute"
            continue
        if isinstance(obj, staticmethod):
            obj = obj.__func__
        if member == "__init__" and "__init__" not in vars(cls):
            continue  # a class made by the core's constructor functions, not Python's
        assert callable(obj), f"{name}.{member} is not a method"
        _check_signature(f"{name}.{member}", decl, getattr(cls, member))
