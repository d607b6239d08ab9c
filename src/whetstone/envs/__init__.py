"""Environments: sandboxes, coding tasks, rewards and cheat detection, the agent harness."""
