"""No module of afd_cupy reads another module's or object's private attribute (issue #32).

Every ``afd_cupy/**/*.py`` is parsed with :mod:`ast` (no import). A *private* name starts with
one underscore and is not a dunder (``_x`` and ``__x``, not ``__x__``). An access is a
violation when it is

- ``obj._x`` (read, write or delete) where ``obj`` is not ``self`` / ``cls`` / ``super()``
  and not a class defined at the top level of the same module (a module may use its own
  classes' privates), including ``self.other._x``, ``mod._x`` of an afd_cupy module, and
  ``getattr``/``setattr``/``hasattr``/``delattr(obj, "_x")`` with such an ``obj``;
- ``from afd_cupy.m import _x`` (any module of afd_cupy, relative imports included).

Out of scope: a module's own module-level privates (``_helper()``, ``_CACHE``: plain names,
not attributes); attribute chains rooted at a third-party module (``torch._grouped_mm``,
``sys._getframe``: their API, not our seams; imports of third-party privates likewise); the
namedtuple API (``_replace``, ``_asdict``, ``_fields``, ``_make``).

:data:`ALLOWED` is a ratchet: the accesses that remain, each with why. A new violation
fails; so does an entry that no longer occurs (remove it from the list).
"""
from __future__ import annotations

import ast
from collections import Counter

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "afd_cupy"
OWN_NAMES = frozenset({"self", "cls"})
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
ATTR_FUNCTIONS = frozenset({"getattr", "setattr", "hasattr", "delattr"})

#: (file relative to afd_cupy/, private name) -> why it is still there. A ratchet: remove an
#: entry when its access goes (the second test fails until you do); never add one for new code.
ALLOWED = {
    # transformers' PreTrainedModel attribute (a third-party object the rule cannot tell apart)
    ("testing/hf_models.py", "_keep_in_fp32_modules_strict"): "transformers' model attribute",
    # third-party objects, not afd_cupy's seams (the rule cannot see an object's type)
    ("moe/expert_formats.py", "_apply_gate"): "transformers' experts method, probed on purpose",
    ("heap/nvshmem_lib.py", "_name"): "ctypes.CDLL._name, the library's path",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.AST) -> str | None:
    """The Name an attribute chain starts from (``a`` of ``a.b.c``), or None."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_super_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def _is_own_module(module: str | None, level: int) -> bool:
    return level > 0 or (module is not None and (module == "afd_cupy" or module.startswith("afd_cupy.")))


def _third_party_names(tree: ast.Module) -> set[str]:
    """Names bound anywhere in the module by an import of a module outside afd_cupy."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _is_own_module(alias.name, 0):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not _is_own_module(node.module, node.level):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _own_classes(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


def _allowed_target(value: ast.AST, third_party: set[str], own_classes: set[str]) -> bool:
    if isinstance(value, ast.Name) and value.id in OWN_NAMES | own_classes:
        return True
    if _is_super_call(value):
        return True
    return _root_name(value) in third_party


def violations_in(source: str) -> list[tuple[int, str, str]]:
    """[(line, private name, the expression)] of one module's source (module doc's rule)."""
    tree = ast.parse(source)
    third_party, own_classes = _third_party_names(tree), _own_classes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in NAMEDTUPLE_API:
            if not _allowed_target(node.value, third_party, own_classes):
                found.append((node.lineno, node.attr, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTR_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and is_private(node.args[1].value)):
            if not _allowed_target(node.args[0], third_party, own_classes):
                found.append((node.lineno, node.args[1].value, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and _is_own_module(node.module, node.level):
            for alias in node.names:
                if is_private(alias.name):
                    found.append((node.lineno, alias.name, f"from {'.' * node.level}{node.module or ''} "
                                                           f"import {alias.name}"))
    return sorted(found)


def package_violations() -> dict[tuple[str, str], list[str]]:
    """(file relative to afd_cupy/, private name) -> ["line: expression", ...] over the package."""
    result: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name, expr in violations_in(path.read_text()):
            result.setdefault((rel, name), []).append(f"{line}: {expr}")
    return result


def test_no_module_reads_another_objects_private_attribute():
    found = package_violations()
    new = {key: where for key, where in found.items() if key not in ALLOWED}
    assert not new, "private attributes read from outside their object/module:\n" + "\n".join(
        f"  afd_cupy/{file}: {name} at {where}" for (file, name), where in sorted(new.items()))


def test_the_allow_list_holds_only_live_entries():
    stale = sorted(set(ALLOWED) - set(package_violations()))
    assert not stale, f"these accesses are gone; remove them from ALLOWED: {stale}"


# --- the rule itself -----------------------------------------------------------------------
def test_the_rule_flags_what_it_names():
    source = '''
import torch
from afd_cupy import wire
from afd_cupy.ffn.worker import _per_layer
import afd_cupy.moe as moe
from . import _sibling
from ._private_mod import thing

class Own:
    _table = {}

    def method(self, other, conn):
        self._ok = 1
        super()._ok_too()
        Own._table.clear()
        torch._grouped_mm(1)
        conn.path._use_device()
        other._state = 2
        getattr(conn, "_pending")
        getattr(self, "_fine")
        wire._private_rule()
        moe._act_and_mul(1)
        conn.path.__class__
        conn.header._replace(seq=1)

def helper(conn):
    return conn._pending
'''
    names = Counter(name for _, name, _ in violations_in(source))
    assert names == Counter({"_per_layer": 1, "_sibling": 1, "_use_device": 1, "_state": 1,
                             "_pending": 2, "_private_rule": 1, "_act_and_mul": 1}), names
