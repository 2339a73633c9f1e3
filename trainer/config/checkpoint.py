"""The `checkpoint:` section of the trainer config."""

from pydantic import Field

from services.config import Strict


class CheckpointConfig(Strict):
    """Where and how often the trainer saves its state."""

    dir: str | None = Field(None, description="Checkpoint folder; None = no checkpoints. Resumes from its latest.")
    interval: int = Field(
        10,
        gt=0,
        description="Save every this many optimizer steps (and at the end). Batches trained since the last save are "
        "acked only after the next one: their leases stay open (heartbeat) until then, so the buffer must hold "
        "about interval x global_batch_size samples beyond what rollout keeps pending.",
    )
    keep_last: int = Field(2, gt=0, description="Checkpoints kept; older ones are deleted.")
    export_dir: str | None = Field(None, description="At the end, write the policy here as a Hugging Face folder.")
