"""The job around the ranks: launching local processes, the rendezvous store, each rank's
:class:`~afd_cupy.runtime.process_context.ProcessContext`, the start-up handshake, roles and
ranks (:mod:`~afd_cupy.runtime.topology`), time bounds, environment variables and what a rank
remembers about its peers (docs/design/startup.md, docs/design/topology.md).

Nothing here touches a GPU; both roles use it.
"""
