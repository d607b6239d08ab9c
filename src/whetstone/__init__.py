"""whetstone: turn a general open model into a specialist coding agent."""

__version__ = "0.1.0"
