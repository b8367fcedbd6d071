"""Refuses to load flashattn in a subinterpreter, before the compiled core
is imported: the core keeps process-wide state (thread pool, engines) and
takes the GIL as the main interpreter's, so there a call would deadlock."""

from __future__ import annotations


def _in_subinterpreter() -> bool:
    for name in ("_interpreters", "_xxsubinterpreters"):  # 3.13+; 3.8 to 3.12
        try:
            interpreters = __import__(name)
        except ImportError:
            continue
        return interpreters.get_current() != interpreters.get_main()
    return False


if _in_subinterpreter():
    raise ImportError("flashattn cannot be imported in a subinterpreter: its compiled core "
                      "supports only the main interpreter")
