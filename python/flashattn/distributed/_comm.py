"""MPI for the ring, kept in one place: mpi4py imported only when a
distributed function runs (``import flashattn.distributed`` works without
it), the communicator argument checked, arrays sent as raw bytes (so any
dtype the engines accept travels unchanged), and shard/gather of arrays
along one axis in either layout."""

from __future__ import annotations

import numbers
import os
import sys

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
    MPI, comm, failure = collective_communicator(fn, comm)
    if failure is not None:
        raise failure
    return MPI, comm


def collective_communicator(fn: str, comm):
    """(MPI, comm, failure) for a collective call: a bad ``comm`` is not
    raised here, where only this rank would see it and the others would wait
    for it forever, but returned as ``failure`` with COMM_WORLD in its place,
    so that the call's agreement (``agree``) raises it on every rank (every
    rank of COMM_WORLD, the other ranks' communicator when they pass the
    default)."""
    MPI = mpi()
    if comm is None or (isinstance(comm, MPI.Comm) and comm == MPI.COMM_WORLD):
        check_launch(fn, MPI)
    if comm is None:
        return MPI, MPI.COMM_WORLD, None
    if not isinstance(comm, MPI.Comm):
        return MPI, MPI.COMM_WORLD, TypeError(
            f"{fn}: comm must be an mpi4py communicator (mpi4py.MPI.Comm) or None, got "
            f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        return MPI, MPI.COMM_WORLD, ValueError(f"{fn}: comm is MPI.COMM_NULL, which no rank "
                                               "belongs to")
    return MPI, comm, None


# What each launcher tells its processes: (variable, launcher, is it a size
# (else a rank: rank r means at least r + 1 ranks)).
_LAUNCH_VARIABLES = (
    ("PMI_SIZE", "MPICH's or Intel MPI's mpiexec (PMI)", True),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", True),
    ("MPI_LOCALNRANKS", "MPICH's mpiexec (Hydra)", True),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun", True),
    ("PMI_RANK", "MPICH's or Intel MPI's mpiexec (PMI)", False),
    ("OMPI_COMM_WORLD_RANK", "Open MPI's mpirun", False),
    ("PMIX_RANK", "a PMIx launcher (Open MPI, srun --mpi=pmix)", False),
)


def launched_as(environ=None) -> tuple[int, str, str]:
    """(P, variable, launcher): the most ranks the launchers' environment
    variables say this process was started among (1, "", "" when none
    does)."""
    environ = os.environ if environ is None else environ
    best = (1, "", "")
    for name, launcher, is_size in _LAUNCH_VARIABLES:
        try:
            n = int(environ.get(name, ""))
        except ValueError:
            continue
        n = n if is_size else n + 1
        if n > best[0]:
            best = (n, f"{name}={environ[name]}", launcher)
    return best


def check_launch(fn: str, MPI) -> None:
    """Refuses to run the ring as one of P independent singletons: when the
    launcher's environment says this process is one of P > 1 ranks but
    MPI.COMM_WORLD has one rank (mpi4py's MPI library is not the one whose
    mpiexec started the ranks: each would compute the whole problem alone),
    RuntimeError naming both and the fix. A communicator passed explicitly
    other than COMM_WORLD (MPI.COMM_SELF: alone on purpose) is not
    checked."""
    if MPI.COMM_WORLD.Get_size() != 1:
        return
    ranks, variable, launcher = launched_as()
    if ranks <= 1:
        return
    try:
        library = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:  # noqa: BLE001  only for the message
        library = "unknown"
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    raise RuntimeError(
        f"{fn}: MPI launch mismatch: the environment says this process is one of at least "
        f"{ranks} ranks ({variable}, set by {launcher}), but MPI.COMM_WORLD has 1 rank, so "
        "every rank would compute the whole problem alone. mpi4py is using another MPI "
        f"library ({library}) than the mpiexec that started this process. Start the ranks "
        "with the mpiexec of mpi4py's MPI library"
        + (f" ({beside}, the mpich wheel's)" if os.path.exists(beside) else "")
        + ", or rebuild mpi4py against the system MPI (pip install --no-binary mpi4py "
        "mpi4py); to run one process alone on purpose, pass comm=MPI.COMM_SELF.")


_KINDS = (TypeError, ValueError, RuntimeError)


def agree(fn: str, comm, local, failure: BaseException | None = None) -> list:
    """Every rank's ``local()`` (this rank's own checks), in rank order, from
    one allgather: if any rank's checks failed (or it brings a ``failure``
    found before), every rank raises that rank's error, naming it, instead
    of the others waiting for it forever. Errors travel as a built-in class
    (TypeError, ValueError, else RuntimeError) and a message, which pickle."""
    mine = (None, None)
    if failure is None:
        try:
            mine = (None, local())
        except Exception as e:  # noqa: BLE001  every rank must hear of it
            failure = e
    if failure is not None:
        kind = next((c for c in _KINDS if isinstance(failure, c)), None)
        message = str(failure) if kind else f"{type(failure).__name__}: {failure}"
        mine = ((kind or RuntimeError, message), None)
    everyone = comm.allgather(mine)
    size = len(everyone)
    for r, (error, _) in enumerate(everyone):
        if error is not None:
            kind, message = error
            where = f"rank {r} of {size}"
            raise kind(f"{message} (on {where})" if message.startswith(fn) else
                       f"{fn} ({where}): {message}")
    return [result for _, result in everyone]


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


def gather(fn: str, MPI, comm, x, layout: str, axis, failure=None) -> np.ndarray:
    """The full array on every rank from each rank's part (Allgatherv); this
    rank's argument checks (and ``failure``, a bad comm) are agreed on first."""
    def local():
        nonlocal x, axis
        plan.check_layout(fn, layout)
        x = _args.array(fn, "x_local", x)
        axis = _axis(fn, axis, x.ndim)
        return x.shape, x.dtype.str

    metas = agree(fn, comm, local, failure)
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
