"""Memory: measuring a training step, gradient-checkpointing policies, and the plan."""
