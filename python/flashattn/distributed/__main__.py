"""``mpiexec -n P python -m flashattn.distributed demo|bench``: the ring
attention command line (_cli.py), run on every rank."""

import sys

from ._cli import main

sys.exit(main(sys.argv[1:]))
