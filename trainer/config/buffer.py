"""The `buffer:` section of the trainer config: the replay buffer the trainer pulls its batches from."""

from pydantic import Field

from services.config import ClientConfig, Strict


class BufferClientConfig(Strict):
    """The replay buffer the trainer pulls from."""

    address: str | None = Field(None, description="host:port of the buffer service.")
    client: ClientConfig = Field(default_factory=ClientConfig, description="TLS / token for the buffer.")
    pull_timeout_s: float = Field(10.0, gt=0, description="Deadline of one Pull call (one batch).")
    max_wait_s: float = Field(600.0, gt=0, description="Give up (TimeoutError) after waiting this long for a batch.")
    lease_timeout_s: float = Field(
        0.0, ge=0, description="Lease per batch, and how far each heartbeat pushes it back; 0 = the buffer's default."
    )
    heartbeat_s: float | None = Field(
        None,
        gt=0,
        description="Extend every held lease (pulled, in training, or trained and waiting for the next checkpoint) "
        "this often; None = lease_timeout_s / 3 (10 s when lease_timeout_s is 0: the buffer's default is 60 s).",
    )
    retry_deadline_s: float = Field(
        120.0,
        gt=0,
        description="Keep retrying a call (Ack, ExtendLease, SetVersion, Stats) that fails UNAVAILABLE or "
        "DEADLINE_EXCEEDED, on a fresh channel with backoff, for this long (a buffer restart), then fail.",
    )
    allow_partial_groups: bool = Field(False, description="Accept batches with incomplete groups.")
    consumer: str = Field("trainer", description="Name the buffer logs this consumer under.")
    prefetch: bool = Field(
        True,
        description="Pull the next batch on a background thread while weights are published and checkpoints "
        "written. It starts once the step before is marked consumed (with its version), so the buffer checks "
        "staleness against the version that batch trains at.",
    )

    @property
    def heartbeat_interval_s(self) -> float:
        if self.heartbeat_s is not None:
            return self.heartbeat_s
        return self.lease_timeout_s / 3 if self.lease_timeout_s > 0 else 10.0
