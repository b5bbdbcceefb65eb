"""Helpers shared by the test layers (tests/unit, tests/kernels, tests/integration, tests/stress).

Imported as ``helpers.<module>``: tests/ is on ``sys.path`` because tests/conftest.py lives
there (pytest's default ``prepend`` import mode puts a rootless conftest's folder first).
Nothing here is collected: no module is named ``test_*``.
"""
