"""The package as a user installs it: a wheel ships the kernels and finds them (issue #32).

The kernel sources live in the repository's top-level ``raw_kernels/``; ``pyproject.toml``
maps them into the package (``afd_cupy/raw_kernels/`` in a wheel) and the loader
(``afd_cupy.kernels.loader.KERNEL_DIR``) takes the installed copy first, the checkout's second.

The build and install tests work on a copy of the tree in a temporary directory, offline
(``--no-deps --no-build-isolation --no-index``: they skip, saying why, where this
interpreter's setuptools cannot build a wheel so), in fresh venvs that see this interpreter's
packages (numpy, torch, numba, pip, setuptools). Each takes a few seconds; the one that
installs the wheel also runs the README's main job (``tools/smoke.py --backend host``) at a
small size, from outside the checkout (~10 s here).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from afd_cupy.kernels import loader

from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
KERNEL_SUFFIXES = (".cu", ".cuh")
#: the main job at a small size (the default size runs ~12 s here; this one a few seconds)
SMOKE_ARGS = ("--backend", "host", "--layers", "2", "--tokens", "16", "--hidden", "64",
              "--experts", "4", "--top-k", "2", "--timeout", "120")


def _kernel_files() -> list[str]:
    """Every kernel source of the checkout, relative to raw_kernels/ (posix)."""
    base = ROOT / "raw_kernels"
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.suffix in KERNEL_SUFFIXES)


def _python_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "afd_cupy").rglob("*.py"))


def _copy_tree(dest: Path) -> Path:
    """What a wheel is built from: pyproject.toml, README.md, afd_cupy/, raw_kernels/."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("afd_cupy", "raw_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    return src


def _clean_env() -> dict:
    """This process's environment without what would put the checkout on a child's path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd, *, cwd, timeout=300) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (f"{cmd} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                                    f"{result.stderr[-4000:]}")
    return result


def _build_wheel(tmp_path: Path) -> Path:
    src = _copy_tree(tmp_path)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", dist, src], cwd=tmp_path)
    wheels = list(dist.glob("afd_cupy-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _venv(path: Path) -> Path:
    """A fresh venv that sees this interpreter's packages (torch, numpy, numba, pip,
    setuptools); its python. ``--system-site-packages`` reaches the base interpreter's only:
    when the tests run inside a venv (CI), a .pth file adds that venv's site-packages too."""
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=path.parent).stdout.strip()
    (Path(purelib) / "_afd_test_outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _offline_build_problem() -> str | None:
    """Why this interpreter cannot build a wheel offline (``--no-build-isolation``), or None:
    setuptools >= 70.1 builds wheels itself, an older one needs the wheel package."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "no setuptools in this interpreter"
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        return None
    return (f"setuptools {version} without the wheel package cannot build a wheel offline "
            "(pip install 'setuptools>=70.1')")


needs_offline_build = pytest.mark.skipif(_offline_build_problem() is not None,
                                         reason=str(_offline_build_problem()))


# --- the configuration -------------------------------------------------------------------
def test_pyproject_ships_every_package_and_kernel_directory():
    """The explicit package list of pyproject.toml names every package of afd_cupy/ and maps
    every kernel directory into afd_cupy.raw_kernels with its .cu/.cuh files as package data
    (a new subpackage or kernel directory that is not listed fails here)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config.get("packages")
    assert isinstance(packages, list), f"tool.setuptools.packages must be an explicit list, got {packages!r}"
    python_packages = {".".join(p.parent.relative_to(ROOT).parts)
                       for p in (ROOT / "afd_cupy").rglob("__init__.py")}
    kernel_dirs = {Path(f).parent for f in _kernel_files()}
    kernel_packages = {".".join(("afd_cupy", "raw_kernels") + d.parts) for d in kernel_dirs}
    wanted = python_packages | kernel_packages
    assert set(packages) == wanted, (f"pyproject.toml [tool.setuptools] packages: add "
                                     f"{sorted(wanted - set(packages))}, remove {sorted(set(packages) - wanted)}")
    assert config.get("package-dir") == {"afd_cupy.raw_kernels": "raw_kernels"}
    data = config.get("package-data", {})
    for package in kernel_packages:
        assert {"*.cu", "*.cuh"} <= set(data.get(package, ())), (package, data.get(package))


def test_kernel_dir_prefers_the_installed_package(tmp_path, monkeypatch):
    installed, checkout = tmp_path / "site" / "raw_kernels", tmp_path / "repo" / "raw_kernels"
    monkeypatch.setattr(loader, "PACKAGE_KERNEL_DIR", installed)
    monkeypatch.setattr(loader, "SOURCE_KERNEL_DIR", checkout)
    assert loader.find_kernel_dir() == installed  # neither: loads name the installed place
    checkout.mkdir(parents=True)
    assert loader.find_kernel_dir() == checkout
    installed.mkdir(parents=True)
    assert loader.find_kernel_dir() == installed


def test_from_the_checkout_the_kernels_are_the_checkouts():
    """Running from the source tree (PYTHONPATH=. or an editable install): no
    afd_cupy/raw_kernels/ there, so the loader reads the top-level raw_kernels/."""
    if loader.PACKAGE_KERNEL_DIR.is_dir():
        pytest.skip(f"afd_cupy is imported from an installed wheel ({loader.PACKAGE_KERNEL_DIR})")
    assert loader.KERNEL_DIR == ROOT / "raw_kernels"
    with pytest.raises(FileNotFoundError, match="not found"):
        loader.kernel_path("no_such_kernel.cu")


# --- the wheel ---------------------------------------------------------------------------
@needs_offline_build
def test_wheel_ships_every_kernel_and_module(tmp_path):
    with zipfile.ZipFile(_build_wheel(tmp_path)) as wheel:
        names = set(wheel.namelist())
    kernels = _kernel_files()
    assert kernels and "common/wire.cuh" in kernels
    missing = [k for k in kernels if f"afd_cupy/raw_kernels/{k}" not in names]
    assert not missing, f"the wheel lacks kernel sources {missing}"
    missing = [f for f in _python_files() if f not in names]
    assert not missing, f"the wheel lacks modules {missing}"
    assert not [n for n in names if n.startswith("raw_kernels/")], "kernels must ship inside afd_cupy"


_CHECK_INSTALL = """
import sys
from pathlib import Path
import afd_cupy
from afd_cupy.kernels import loader
package = Path(afd_cupy.__file__).resolve().parent
assert package.is_relative_to(Path(sys.prefix).resolve()), (package, sys.prefix)
assert loader.KERNEL_DIR == package / "raw_kernels", (loader.KERNEL_DIR, package)
missing = [f for f in sys.argv[1:] if not (loader.KERNEL_DIR / f).is_file()]
assert not missing, missing
for f in loader.FILE_KERNELS:
    assert loader.source_key(f)  # every include resolves inside the package
print("INSTALLED", loader.KERNEL_DIR)
"""


@needs_offline_build
def test_installed_wheel_finds_its_kernels_and_runs_the_main_job(tmp_path):
    """A non-editable install of the wheel into a fresh venv: KERNEL_DIR is inside the
    installed package and holds every kernel file; then ``tools/smoke.py`` (copied out of the
    checkout, run from outside it: its own sys.path entry holds no afd_cupy) PASSes on the
    host backend against the installed package."""
    wheel = _build_wheel(tmp_path)
    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", wheel], cwd=tmp_path)
    outside = tmp_path / "outside"
    (outside / "tools").mkdir(parents=True)
    result = _run([python, "-c", _CHECK_INSTALL, *_kernel_files()], cwd=outside)
    assert "INSTALLED" in result.stdout
    shutil.copy(ROOT / "tools" / "smoke.py", outside / "tools" / "smoke.py")
    result = _run([python, "tools/smoke.py", *SMOKE_ARGS], cwd=outside, timeout=240)
    assert "PASS backend=host" in result.stdout, result.stdout


@needs_offline_build
def test_editable_install_finds_the_checkout_kernels(tmp_path):
    """``pip install -e .`` of the (copied) tree: KERNEL_DIR is the tree's raw_kernels/."""
    src = _copy_tree(tmp_path)
    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", src],
         cwd=tmp_path)
    result = _run([python, "-c", "from afd_cupy.kernels import loader; print(loader.KERNEL_DIR)"],
                  cwd=tmp_path)
    assert Path(result.stdout.strip()) == src / "raw_kernels"
