"""What the conductor's state tells of its reservations (replica_sync.py listens)."""

from __future__ import annotations

from typing import Protocol


class ReservationListener(Protocol):
    """Told of every reservation opened and closed by a ConductorState. Called on the
    hot path, from the event loop: must only queue."""

    def opened(self, res, prefill_s: float) -> None: ...

    def closed(self, res, linger_s: float, resident: bool) -> None: ...

    def prefilled(self, res) -> None: ...
