"""The package cut by role (issue #32, docs/decisions/0025-package-by-role.md): every module path
from before the cut still imports, as the very module at its new path, with a DeprecationWarning
that names the new path; nothing in this repository uses an old path any more."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest

import afd_cupy
from afd_cupy.old_paths import MOVED, MovedModuleFinder

from helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "afd_cupy"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_and_warns(old):
    new = importlib.import_module(f"afd_cupy.{MOVED[old]}")
    sys.modules.pop(f"afd_cupy.{old}", None)  # the finder answers only a first import
    with pytest.warns(DeprecationWarning, match=re.escape(f"afd_cupy.{MOVED[old]}")):
        aliased = importlib.import_module(f"afd_cupy.{old}")
    assert aliased is new
    assert getattr(afd_cupy, old) is new


def test_names_imported_through_an_old_path_are_the_same_objects():
    from afd_cupy.ffn.worker import FFNWorker
    from afd_cupy.runtime.launch import ProcessContext, launch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from afd_cupy.ffn_worker import FFNWorker as old_worker
        from afd_cupy.launch import ProcessContext as old_context, launch as old_launch
    assert (old_worker, old_context, old_launch) == (FFNWorker, ProcessContext, launch)


def test_the_finder_answers_only_the_moved_names():
    finder = MovedModuleFinder()
    assert finder.find_spec("afd_cupy.connector") is None
    assert finder.find_spec("afd_cupy.not_a_module") is None
    assert finder.find_spec("other.ffn_worker") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("afd_cupy.not_a_module")


def test_every_old_file_is_gone_and_every_new_one_is_there():
    for old, new in MOVED.items():
        assert not (PACKAGE / f"{old}.py").exists(), old
        assert (PACKAGE / (new.replace(".", "/") + ".py")).is_file(), new


def test_a_fresh_interpreter_imports_an_old_path_without_the_new_one_first():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import afd_cupy.ffn_worker\nexcept DeprecationWarning as w:\n"
            "    print('warned', w)\n"
            "warnings.simplefilter('ignore')\n"
            "import afd_cupy.ffn_worker as a, afd_cupy.ffn.worker as b\n"
            "print('same', a is b, a.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warned afd_cupy.ffn_worker moved to afd_cupy.ffn.worker" in out.stdout
    assert "same True afd_cupy.ffn.worker" in out.stdout


def test_nothing_in_the_repository_imports_an_old_path():
    names = "|".join(sorted(MOVED, key=len, reverse=True))
    dotted = re.compile(r"\bafd_cupy\.(" + names + r")\b")
    from_import = re.compile(r"from afd_cupy import \(?([\w, ]+)")
    hits = []
    for root in ("afd_cupy", "tests", "tools"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            if path.name in ("old_paths.py", "test_old_paths.py"):
                continue
            text = path.read_text()
            hits += [f"{path.relative_to(REPO_ROOT)}: afd_cupy.{m}" for m in dotted.findall(text)]
            for group in from_import.findall(text):
                hits += [f"{path.relative_to(REPO_ROOT)}: from afd_cupy import {n.strip()}"
                         for n in group.split(",") if n.strip().split(" ")[0] in MOVED]
    assert not hits, hits
