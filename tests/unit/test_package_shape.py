"""The package's shape (issue #32, docs/decisions/0025-package-by-role.md): rooms by role, the
public API alone on top, no library module over 400 lines."""
from __future__ import annotations

from helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "afd_cupy"
MAX_LINES = 400
TOP_LEVEL = {"__init__.py", "adapters.py", "config.py", "connector.py", "errors.py", "handles.py",
             "old_paths.py"}
ROOMS = {"attention", "backends", "capacity", "ffn", "heap", "kernels", "moe", "routing", "runtime",
         "testing", "transports", "wire"}


def test_no_library_module_over_400_lines():
    long = {str(path.relative_to(REPO_ROOT)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_top_level_holds_the_public_api_and_the_rooms():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert modules == TOP_LEVEL
    assert rooms == ROOMS
