"""``python -m phalanx ...`` is ``phalanx ...``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
