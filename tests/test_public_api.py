"""Every public function and class of ``causalattn.__all__`` is annotated and documented.

Walks ``causalattn.__all__``: each function, and each class with its constructor, public
methods and properties, must annotate every parameter and its return (a constructor
returns None) and carry a docstring; where a parameter is an array (``Array``,
``ArrayLike``, ``Tensor``, ``ndarray``) the docstring names its shapes (``(B, H, T, d)``,
``T×d_k``). The ``py.typed`` marker ships with the package (PEP 561).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import causalattn

SHAPE = re.compile(r"\((?:[\w|·+−-]+, )+[\w|·+−-]+\)|[\w)]+ ?× ?[\w(]+")
ARRAY = re.compile(r"\b(Array|ArrayLike|Tensor|ndarray)\b")


def _callable_problems(qual: str, fn, *, method: bool = False, doc: str | None = None) -> list[str]:
    """What ``fn`` lacks; ``doc``: the docstring that documents it (default its own)."""
    problems = []
    ann = fn.__annotations__
    for name in inspect.signature(fn).parameters:
        if method and name in ("self", "cls"):
            continue
        if name not in ann:
            problems.append(f"{qual}: parameter {name!r} has no annotation")
    if "return" not in ann:
        problems.append(f"{qual}: no return annotation")
    doc = doc if doc is not None else inspect.getdoc(fn)
    takes_arrays = any(ARRAY.search(str(a)) for k, a in ann.items() if k != "return")
    if not doc:
        problems.append(f"{qual}: no docstring")
    elif takes_arrays and not SHAPE.search(doc):
        problems.append(f"{qual}: takes arrays, but its docstring names no shape")
    return problems


def _class_problems(name: str, cls: type) -> list[str]:
    problems = [] if inspect.getdoc(cls) else [f"{name}: no docstring"]
    for attr, value in vars(cls).items():
        if attr.startswith("_") and attr != "__init__":
            continue
        if isinstance(value, property):
            if not inspect.getdoc(value):
                problems.append(f"{name}.{attr}: property without a docstring")
            if value.fget is not None and "return" not in value.fget.__annotations__:
                problems.append(f"{name}.{attr}: property without a return annotation")
            continue
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if inspect.isfunction(value):
            qual = f"{name}.{attr}"
            if attr == "__init__":  # documented by the class's docstring, returns None
                doc = "\n".join(filter(None, [inspect.getdoc(cls), inspect.getdoc(value)]))
                found = _callable_problems(qual, value, method=True, doc=doc)
                problems += [p for p in found if "no return annotation" not in p]
            else:
                problems += _callable_problems(qual, value, method=True)
    return problems


def _public():
    for name in causalattn.__all__:
        obj = getattr(causalattn, name)
        if not inspect.ismodule(obj):
            yield name, obj


@pytest.mark.parametrize(("name", "obj"), list(_public()), ids=[n for n, _ in _public()])
def test_public_name_is_annotated_and_documented(name, obj):
    if inspect.isclass(obj):
        problems = _class_problems(name, obj)
    else:
        problems = _callable_problems(name, obj)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_it_looks_for():
    def bare(q, k):
        return q

    def shapeless(q: Array) -> Array:  # noqa: F821 (annotations are strings here)
        """Attention."""
        return q

    class Thing:
        """A thing."""

        def __init__(self, x: int) -> None:
            self.x = x

        @property
        def y(self):
            return 1

    assert len(_callable_problems("bare", bare)) == 4  # two parameters, return, docstring
    assert _callable_problems("shapeless", shapeless) == [
        "shapeless: takes arrays, but its docstring names no shape"
    ]
    assert _class_problems("Thing", Thing) == [
        "Thing.y: property without a docstring",
        "Thing.y: property without a return annotation",
    ]


def test_the_package_ships_its_py_typed_marker():
    assert (Path(causalattn.__file__).parent / "py.typed").is_file()
