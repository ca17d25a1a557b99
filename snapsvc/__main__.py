"""``python -m snapsvc``: the same command line as the ``snapsvc`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
