"""``python -m phalanx.bench``: the worker ``phalanx bench`` starts on every rank."""

from .engine import main

main()
