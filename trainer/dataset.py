"""A batch source over a fixed list of samples (SFT / DPO data), for the same training loop that
pulls from the replay buffer."""

import random
from collections.abc import Sequence

from protos.sample import Sample
from trainer.buffer_client import LeasedBatch


class DatasetSource:
    """Seeded epochs over `samples`, `batch_size` at a time; acks are counted, nothing is redelivered."""

    def __init__(self, samples: Sequence[Sample], seed: int = 0):
        if not samples:
            raise ValueError("DatasetSource needs at least one sample")
        self.samples = list(samples)
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.batches = 0
        self.acked = 0

    def pull(self, batch_size: int) -> LeasedBatch:
        picked = []
        while len(picked) < batch_size:
            if not self.order:
                self.order = list(range(len(self.samples)))
                self.rng.shuffle(self.order)
            picked.append(self.samples[self.order.pop()])
        self.batches += 1
        return LeasedBatch(lease_id=f"dataset-{self.batches}", samples=picked, trainer_version=0)

    def ack(self, lease_id: str, trainer_version: int | None = None) -> int:
        self.acked += 1
        return 1

    def extend(self, lease_ids: list[str], consumed: bool = False, trainer_version: int | None = None) -> list[str]:
        return []

    def set_version(self, version: int) -> int:
        return 0

    def trainer_version(self) -> int:
        return 0
