"""Small helpers shared by every role: atomic writes, progress bars, metrics files."""
