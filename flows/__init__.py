"""Prefect flows: the five-phase fine-tune, and later retraining and export deployments."""
