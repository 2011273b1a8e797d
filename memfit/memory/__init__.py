"""Memory, in three parts: techniques applied to a model or step, the estimator, the planner (arrows one way)."""
