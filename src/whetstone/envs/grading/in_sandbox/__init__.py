"""Run inside the grading sandbox, mounted beside each other: stdlib only, nothing from whetstone."""
