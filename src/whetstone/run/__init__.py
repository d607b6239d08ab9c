"""`whetstone run`: the whole pipeline on one machine (see docs/architecture.md)."""
