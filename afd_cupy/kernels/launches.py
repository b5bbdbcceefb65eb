"""Checked kernel launches: the argument checks, :class:`LaunchSpec` and :class:`PackedLaunch`.

A spec builder (:mod:`afd_cupy.kernels.specs`) checks its arguments once
(:mod:`afd_cupy.kernels.checks`) and returns a
:class:`LaunchSpec` whose argument names are the kernel's C parameter names. Scalars are numpy
scalars of the C type, arrays are CuPy arrays, the window geometry is a numpy structured scalar
(``struct SlotGeometry``). :class:`PackedLaunch` packs a spec into a ``cuLaunchKernel``
parameter block; ``LaunchSpec.launch`` goes through it too, so every launch packs its
arguments the same way. Only launching imports CuPy.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np



# --- specs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchSpec:
    """A checked launch: kernel, grid, block, dynamic shared memory and named arguments.

    ``names`` are the kernel's C parameter names, in order; ``launch(stream)`` packs and
    launches it once; :class:`PackedLaunch` packs it once for repeated launches.
    """

    kernel: object  # cupy.RawKernel
    grid: int
    block: int
    shared_mem: int
    names: tuple
    args: tuple

    def launch(self, stream=None) -> None:
        """Launch on ``stream`` (a ``cupy.cuda.Stream``; default: CuPy's current stream)."""
        if stream is None:
            import cupy

            stream = cupy.cuda.get_current_stream()
        PackedLaunch(self).launch(stream.ptr)


def launch_spec(kernel, grid: int, block: int, args: dict, shared_mem: int = 0) -> LaunchSpec:
    """The :class:`LaunchSpec` of ``kernel`` with ``args`` (C parameter name -> checked value,
    in the kernel's order)."""
    return LaunchSpec(kernel, int(grid), int(block), int(shared_mem), tuple(args), tuple(args.values()))


_STRUCT_CELLS: dict = {}


def _struct_cell_type(nbytes: int):
    """A ctypes cell of ``nbytes`` raw bytes whose ``value`` reads and writes those bytes."""
    cell_type = _STRUCT_CELLS.get(nbytes)
    if cell_type is None:
        def _get(cell) -> bytes:
            return ctypes.string_at(ctypes.addressof(cell), nbytes)

        def _set(cell, value) -> None:
            raw = value.tobytes() if isinstance(value, np.void) else bytes(value)
            if len(raw) != nbytes:
                raise ValueError(f"struct argument needs {nbytes} bytes, got {len(raw)}")
            ctypes.memmove(ctypes.addressof(cell), raw, nbytes)

        cell_type = type(f"_Struct{nbytes}", (ctypes.Structure,),
                         {"_fields_": [("raw_bytes", ctypes.c_uint8 * nbytes)],
                          "value": property(_get, _set)})
        _STRUCT_CELLS[nbytes] = cell_type
    return cell_type


def _cell(name: str, value):
    """The ctypes cell holding one kernel argument."""
    device_ptr = getattr(getattr(value, "data", None), "ptr", None)
    if device_ptr is not None:  # a cupy.ndarray: its device pointer
        return ctypes.c_uint64(device_ptr)
    if isinstance(value, np.void):  # a struct passed by value (SlotGeometry)
        cell = _struct_cell_type(value.dtype.itemsize)()
        cell.value = value
        return cell
    ctype = PackedLaunch.CTYPES.get(type(value))
    if ctype is None:
        raise TypeError(f"argument {name} has type {type(value).__name__}; expected a cupy "
                        f"array, a numpy structured scalar or one of "
                        f"{sorted(t.__name__ for t in PackedLaunch.CTYPES)}")
    return ctype(value.item())


class PackedLaunch:
    """A :class:`LaunchSpec` packed once into a ``cuLaunchKernel`` parameter block.

    The hot paths of the cuda backend launch the same kernels with the same buffers over and
    over; only a few scalars and pointers change (token count, hidden pointer, layer, seq).
    The spec's checks run once, when it is built; after that ``set(name, value)`` rewrites one
    argument in place and ``launch(stream_ptr, grid)`` is one driver call. A struct argument
    (``geo``) is a byte cell of the struct's size; ``set`` takes a numpy structured scalar.

    NOTE: ``set`` does not validate: pass only what the spec builder accepts for that
    argument (pointers as ``int`` addresses, counts within the buffers the spec was checked
    against). CUDA copies the parameter block at launch, so it can be rewritten right after.
    """

    CTYPES = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64,
              np.uint32: ctypes.c_uint32, np.float32: ctypes.c_float}

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.grid, self.block, self.shared_mem = spec.grid, spec.block, spec.shared_mem
        self.function_ptr = int(spec.kernel.kernel.ptr)
        self._slots = {name: _cell(name, value) for name, value in zip(spec.names, spec.args)}
        cells = list(self._slots.values())
        self._params = (ctypes.c_void_p * max(1, len(cells)))(*[ctypes.addressof(c) for c in cells])
        self.params_ptr = ctypes.addressof(self._params)
        self._launch_kernel = None  # cupy.cuda.driver.launchKernel, bound at the first launch

    def set(self, name: str, value) -> None:
        """Rewrite argument ``name`` (an address as ``int`` for pointer arguments)."""
        self._slots[name].value = value

    def get(self, name: str):
        return self._slots[name].value

    def launch(self, stream_ptr: int, grid: int | None = None) -> None:
        """Launch on the raw stream handle ``stream_ptr`` with ``grid`` blocks (default: the spec's)."""
        launch_kernel = self._launch_kernel
        if launch_kernel is None:
            import cupy

            launch_kernel = self._launch_kernel = cupy.cuda.driver.launchKernel
        launch_kernel(self.function_ptr, self.grid if grid is None else grid, 1, 1,
                      self.block, 1, 1, self.shared_mem, stream_ptr, self.params_ptr, 0)
