"""Measuring and estimating a step's memory: tracker, the step on real or fake tensors, composition, timelines."""
