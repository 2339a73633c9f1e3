"""What one publish did: each receiver's outcome and the publish's timings (broadcaster.py fills them)."""

from dataclasses import dataclass


@dataclass
class ReceiverResult:
    """What one receiver did with one publish."""

    address: str
    ok: bool
    error: str | None = None
    version: int | None = None  # the version it serves after this publish, when it said so
    not_newer: bool = False  # BeginUpdate refused the version: the receiver serves this one or a later one
    receive_s: float = 0.0
    switch_s: float = 0.0
    pause_s: float = 0.0  # how long its engine generated nothing for this update (the receiver's measure)


@dataclass
class PublishReport:
    """Outcome and timings of one publish."""

    version: int
    results: list[ReceiverResult]
    bytes: int = 0
    begin_s: float = 0.0  # BeginUpdate round(s)
    rendezvous_s: float = 0.0  # forming a new group (0 when reused)
    transfer_s: float = 0.0  # broadcasting every bucket
    commit_s: float = 0.0  # waiting for the CommitUpdate replies after the last bucket went out
    total_s: float = 0.0
    group_reused: bool = False
    full_bytes: int = 0  # what the whole version weighs (`bytes` is what went out)
    partial: bool = False  # sent as a change of a base version (delta)
    fallbacks: int = 0  # so far: partial versions sent whole instead (delta.py)

    @property
    def ok(self) -> bool:
        """Every receiver switched to the new version."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def pause_s(self) -> float:
        """The longest any receiver's engine stopped generating for this publish (0 when none switched); it lies
        within total_s, the publish's sync time, of which the receivers generate through the rest."""
        return max((r.pause_s for r in self.results if r.ok), default=0.0)

    @property
    def failed(self) -> dict[str, str]:
        return {r.address: r.error or "failed" for r in self.results if not r.ok}

    @property
    def not_newer(self) -> list[str]:
        """Receivers that refused this version as not newer than the one they serve."""
        return [r.address for r in self.results if r.not_newer]
