"""The Prefect global concurrency limit that keeps two training runs off one GPU."""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.exceptions import ObjectNotFound


def ensure_training_slots(name: str, slots: int) -> None:
    """Create the limit on first use (an absent limit would silently not limit anything)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
            except Exception:  # noqa: BLE001 - created concurrently by another run: fine
                client.read_global_concurrency_limit_by_name(name)
