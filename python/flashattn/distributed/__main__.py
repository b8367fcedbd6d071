"""``mpiexec -n P python -m flashattn.distributed demo|bench``: the ring
attention command line (_cli.py), run on every rank. Without mpi4py it says
in one line how to install it (no traceback)."""

import sys

from ._cli import main
from ._comm import mpi

try:
    mpi()
except ImportError as e:
    sys.exit(f"python -m flashattn.distributed: {e}")
sys.exit(main(sys.argv[1:]))
