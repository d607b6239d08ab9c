"""Checks of a benchmark's options, made before anything starts: a value no benchmark can run
with is refused naming the option, not found minutes in as a traceback."""

from __future__ import annotations

from whetstone.errors import WhetstoneError


def check_at_least(*limits: tuple[str, float, float]) -> None:
    """Refuse the first (name, value, least) whose value is below its least."""
    for name, value, least in limits:
        if value < least:
            raise WhetstoneError(f"{name} must be >= {least}, got {value}")
