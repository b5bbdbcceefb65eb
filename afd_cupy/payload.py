"""Old home of the payload dtype helpers, now in :mod:`afd_cupy.dtypes`.

Kept only for ``connector.py`` and ``backend_host.py`` until they import
:mod:`afd_cupy.dtypes`; delete this module then.
"""
from afd_cupy.dtypes import raw_dtype, raw_to_f32, raw_to_torch, torch_dtype, torch_to_raw  # noqa: F401
