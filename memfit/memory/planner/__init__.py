"""Choosing the stack that fits: candidates, search over estimates, the plan and its cache, limits, the watch."""
