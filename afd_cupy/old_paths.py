"""Module paths of afd_cupy before the package was cut by role, and the import hook that keeps
them working (docs/decisions/0025-package-by-role.md).

``import afd_cupy.ffn_worker`` gives the very module object ``afd_cupy.ffn.worker`` (one module,
one set of globals, so ``isinstance`` checks and monkeypatching see the same names) and warns
once with a :class:`DeprecationWarning` that names the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old module name under afd_cupy -> its module now, under afd_cupy
MOVED = {
    "children": "runtime.children", "env": "runtime.env", "kvstore": "runtime.kvstore",
    "launch": "runtime.launch", "orphan": "runtime.orphan", "placement": "runtime.placement",
    "process_context": "runtime.process_context", "rendezvous": "runtime.rendezvous",
    "store": "runtime.store", "timeouts": "runtime.timeouts", "handshake": "runtime.handshake",
    "topology": "runtime.topology", "connector_setup": "runtime.connector_setup",
    "peer_state": "runtime.peer_state",
    "attention_endpoint": "attention.endpoint", "step_graph": "attention.step_graph",
    "step_schedule": "attention.step_schedule",
    "ffn_endpoint": "ffn.endpoint", "ffn_batch": "ffn.batch", "ffn_graph": "ffn.graph",
    "ffn_lockstep": "ffn.lockstep", "ffn_overlap": "ffn.overlap", "ffn_recorder": "ffn.recorder",
    "ffn_serving": "ffn.serving", "ffn_weights": "ffn.weights", "ffn_worker": "ffn.worker",
    "seq": "wire.seq", "layout": "wire.layout", "dtypes": "wire.dtypes",
    "window": "heap.window",
    "gates": "moe.gates", "expert_formats": "moe.expert_formats", "expert_gemm": "moe.expert_gemm",
    "planner": "routing.planner", "dedup": "routing.dedup",
}


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (already imported or imported now)."""

    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        return importlib.import_module(self.new_name)

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported under its own name


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``afd_cupy.<old>`` for every old name in :data:`MOVED`; nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != "afd_cupy" or old not in MOVED:
            return None
        new_name = "afd_cupy." + MOVED[old]
        warnings.warn(f"{fullname} moved to {new_name}; import it from there "
                      f"(the old path is an alias of the same module)",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` once per interpreter."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
