"""MPI for the ring, kept in one place: mpi4py imported only when a
distributed function runs (``import flashattn.distributed`` works without
it), the communicator argument checked, arrays sent as raw bytes (so any
dtype the engines accept travels unchanged), and shard/gather of arrays
along one axis in either layout."""

from __future__ import annotations

import numbers

import numpy as np

from .. import _args
from . import _plan as plan


def mpi():
    """mpi4py.MPI, or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "flashattn.distributed needs mpi4py and an MPI library: pip install "
            "'flashattn[mpi]' (mpi4py and MPICH from PyPI wheels), then start the ranks "
            f"with mpiexec -n P python ... ({e})"
        ) from e
    return MPI


def communicator(fn: str, comm):
    """(MPI, comm): comm=None is MPI.COMM_WORLD."""
    MPI = mpi()
    if comm is None:
        return MPI, MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"{fn}: comm must be an mpi4py communicator (mpi4py.MPI.Comm) or None, "
                        f"got {type(comm).__name__}")
    return MPI, comm


def raw(x: np.ndarray) -> np.ndarray:
    """A C-contiguous array as a flat uint8 view (no copy): MPI sends bytes."""
    assert x.flags.c_contiguous
    return x.reshape(-1).view(np.uint8)


def _axis(fn: str, axis, ndim: int) -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{fn}: axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -ndim <= int(axis) < ndim:
        raise ValueError(f"{fn}: axis {int(axis)} is out of range for an array of {ndim} "
                         f"dimensions")
    return int(axis) % ndim


def shard(fn: str, comm, x, layout: str, axis) -> np.ndarray:
    """This rank's part of the full array x (a copy): contiguous, the r-th of
    numpy.array_split's P parts; zigzag, its parts r and 2P - 1 - r of 2P."""
    layout = plan.check_layout(fn, layout)
    x = _args.array(fn, "x", x)
    axis = _axis(fn, axis, x.ndim)
    rank, size = comm.Get_rank(), comm.Get_size()
    if layout == "contiguous":
        part = np.array_split(x, size, axis=axis)[rank]
    else:
        chunks = np.array_split(x, 2 * size, axis=axis)
        part = np.concatenate([chunks[rank], chunks[2 * size - 1 - rank]], axis=axis)
    return np.array(part, order="C", copy=True)  # the full array need not stay alive


def gather(fn: str, MPI, comm, x, layout: str, axis) -> np.ndarray:
    """The full array on every rank from each rank's part (Allgatherv)."""
    layout = plan.check_layout(fn, layout)
    x = _args.array(fn, "x_local", x)
    axis = _axis(fn, axis, x.ndim)
    metas = comm.allgather((x.shape, x.dtype.str))
    shape0, dtype0 = metas[0]
    for r, (shape, dtype) in enumerate(metas):
        others = shape[:axis] + shape[axis + 1:]
        others0 = shape0[:axis] + shape0[axis + 1:]
        if len(shape) != len(shape0) or dtype != dtype0 or others != others0:
            raise ValueError(f"{fn}: rank {r} has x_local of shape {shape} and dtype {dtype}, "
                             f"rank 0 of shape {shape0} and dtype {dtype0}; the parts may differ "
                             f"only along axis {axis}")
    lengths = [shape[axis] for shape, _ in metas]
    plan.check_lengths(fn, "x_local", layout, lengths)
    moved = np.ascontiguousarray(np.moveaxis(x, axis, 0))
    rest = moved.shape[1:]
    row = int(np.prod(rest, dtype=np.int64)) * x.dtype.itemsize
    total = sum(lengths)
    out = np.empty((total,) + rest, x.dtype)
    if row and total:
        counts = [n * row for n in lengths]
        displs = [sum(counts[:r]) for r in range(len(counts))]
        comm.Allgatherv(raw(moved), [raw(out), counts, displs, MPI.BYTE])
    if layout == "zigzag":
        size = len(lengths)
        chunks = plan.zigzag_chunks(total, size)
        ordered = np.empty_like(out)
        offset = 0
        for r in range(size):
            for c in (r, 2 * size - 1 - r):
                start, n = chunks[c]
                ordered[start:start + n] = out[offset:offset + n]
                offset += n
        out = ordered
    return np.ascontiguousarray(np.moveaxis(out, 0, axis))
