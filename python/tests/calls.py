"""Counting the package's C calls, for tests of lifetimes (test_api.py, ranks.py)."""

from __future__ import annotations

from typing import Callable


def count_calls() -> tuple[list[str], Callable[[], None]]:
    """Records the name of every C call the package makes from now on (it calls through
    ``_native.call``, looked up at each call); returns the names and a function that stops
    recording."""
    import mscclpp_rs._native as native

    names: list[str] = []
    orig = native.call

    def counting(name: str, *args: object) -> None:
        names.append(name)
        orig(name, *args)

    def restore() -> None:
        native.call = orig

    native.call = counting
    return names, restore
