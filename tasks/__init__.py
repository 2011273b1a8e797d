"""Thin Prefect tasks over memfit's phases: retries, timeouts, artifacts; no logic of their own."""
