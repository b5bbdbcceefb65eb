"""Where the checkout's folders are, for tests that read sources or run tools."""
from __future__ import annotations

from pathlib import Path

#: the repository root (tests/helpers/paths.py -> tests/helpers -> tests -> root)
REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS_DIR = REPO_ROOT / "tools"
RAW_KERNELS_DIR = REPO_ROOT / "raw_kernels"
