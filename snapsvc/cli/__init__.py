"""The ``snapsvc`` command line (also ``python -m snapsvc``).

What each module holds::

    core.py      the command registry, the parser, output helpers, main()
    files.py     inspect, verify: read checkpoints, change nothing
    rewrite.py   convert, migrate, consolidate: write a checkpoint from another
    tools.py     demo (the main job) and bench (the stall benchmark)
    demo.py      the demo's training run

The top layer: it may import anything below it; nothing imports it but ``__main__``.
"""

from .core import (COMMANDS, EXIT_FAILURE, EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, Command,
                   ProgressBar, UsageError, build_parser, human_bytes, main, register)

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_INCOMPLETE", "EXIT_OK", "EXIT_USAGE", "Command",
           "ProgressBar", "UsageError", "build_parser", "human_bytes", "main", "register"]
