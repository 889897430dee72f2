"""A clock a test moves by hand: monotonic seconds for the chain and its parts."""

from __future__ import annotations


class Clock:
    """Returns :attr:`now`; a test advances it (``clock.now += 1.0``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
