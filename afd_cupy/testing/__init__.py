"""Test and benchmark helpers, not production code.

- :mod:`afd_cupy.testing.reference`: deterministic expert weights, the naive fp64 MoE
  reference, identity experts for transport-only runs.
- :mod:`afd_cupy.testing.scenario`: the reference end-to-end scenario run by the tests and
  ``tools/smoke.py``.

Nothing in the library imports this package.
"""
