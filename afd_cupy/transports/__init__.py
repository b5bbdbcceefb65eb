"""Transports: how a message reaches the peer's window (docs/design/put-transport.md).

``ConnectorConfig.transport`` names one registered :class:`Transport`: ``direct`` (the
default; :mod:`~afd_cupy.transports.direct`), ``put`` and ``auto``
(:mod:`~afd_cupy.transports.put`). A new transport is one module: a :class:`Transport` and
its :class:`Link` (:mod:`~afd_cupy.transports.base`), made selectable by :func:`register`.
Importing this package registers the built-ins and needs no GPU.
"""
from afd_cupy.transports.base import (Link, Transport, get_transport, register, transport_names,
                                      transports_of, unregister)
from afd_cupy.transports import direct, put  # noqa: F401 - registers direct, put, auto

__all__ = ["Link", "Transport", "get_transport", "register", "transport_names", "transports_of",
           "unregister"]
