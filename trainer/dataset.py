"""A batch source over a fixed list of samples (SFT / DPO data), for the same training loop that
pulls from the replay buffer."""

import random
from collections.abc import Sequence

from protos.sample import Sample
from trainer.buffer_client import LeasedBatch


class DatasetSource:
    """Seeded epochs over `samples`, `batch_size` at a time; acks are counted, nothing is redelivered.

    Samples of one group (group_id: a DPO pair, the completions of one prompt) travel together, as the
    buffer delivers them: the learner expects whole groups. A batch is whole groups until it holds at least
    `batch_size` samples (exactly that many when the group sizes divide it).
    """

    def __init__(self, samples: Sequence[Sample], seed: int = 0):
        if not samples:
            raise ValueError("DatasetSource needs at least one sample")
        self.samples = list(samples)
        groups: dict[str, list[int]] = {}
        for index, sample in enumerate(self.samples):
            groups.setdefault(sample.group_id, []).append(index)
        self.groups = list(groups.values())
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.batches = 0
        self.acked = 0

    def pull(self, batch_size: int, trainer_version: int | None = None) -> LeasedBatch:
        picked = []
        while len(picked) < batch_size:
            if not self.order:
                self.order = list(range(len(self.groups)))
                self.rng.shuffle(self.order)
            picked.extend(self.samples[index] for index in self.groups[self.order.pop()])
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
