"""A replay buffer over a temporary data dir for the buffer's log and recovery tests: opened, crashed, reopened."""

from buffer_samples import sample_proto

from services.buffer.buffer import ReplayBuffer
from services.buffer.config import BufferConfig


def make_sample(sample_id: str, **fields) -> bytes:
    """A serialized sample, as the buffer stores it."""
    return sample_proto(sample_id, **fields).SerializeToString()


def segment_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix == ".seg")


def config(path, **overrides) -> BufferConfig:
    return BufferConfig(data_dir=str(path), **{"fsync": "never", **overrides})


async def opened(cfg: BufferConfig) -> ReplayBuffer:
    buffer = ReplayBuffer.open(cfg)
    await buffer.start()
    return buffer


class Clock:
    """The buffer's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def opened_at(cfg: BufferConfig, clock: Clock) -> ReplayBuffer:
    buffer = ReplayBuffer.open(cfg, clock=clock)
    await buffer.start()
    return buffer


def pending_ids(buffer: ReplayBuffer) -> set[str]:
    return set(buffer.store._entries)
