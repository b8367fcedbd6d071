"""The command line behind ``python -m flashattn`` (flashattn/__main__.py
picks the subcommand): ``report`` (report.py), ``bench`` and its sections
(bench/), ``train`` (train.py), ``info`` (info.py); args.py holds the
argument types they share. Nothing here is imported by ``import flashattn``."""
