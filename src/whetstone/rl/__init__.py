"""The RL algorithm core: trajectories → samples → batches, group advantages, the policy loss,
bounded staleness. Pure functions and small records; the orchestrator and trainer build on them."""
