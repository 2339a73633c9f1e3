"""What the replay buffer's index holds: an entry per held sample, a group per group, a lease per batch
out, and what a consumer asks for (PullSpec). Data only; index.py and store.py act on it."""

import enum
from dataclasses import dataclass, field
from typing import Any

GroupKey = tuple[str, str]  # ("group", group_id) or ("sample", sample_id) for a sample of its own


class EntryState(enum.Enum):
    STAGED = "staged"
    PENDING = "pending"
    LEASED = "leased"


class Policy(enum.Enum):
    FIFO = "fifo"  # oldest first, each sample once
    UNIFORM = "uniform"  # uniform random replay, each sample up to `max_reuse` times


class GroupSizeConflict(ValueError):
    """Samples of one group disagree on the group's size."""


class LeaseNotFound(KeyError):
    """No open lease has this id: it was acked already, it expired, or it never existed."""


@dataclass(frozen=True, slots=True)
class NewSample:
    """What the index needs to know about a sample; the payload stays where `ref` points."""

    sample_id: str
    group_id: str
    group_size: int
    oldest_version: int  # oldest policy version of a trained-on token (-1: none, never stale)
    ref: Any = None

    @property

    def group_key(self) -> GroupKey:
        return ("group", self.group_id) if self.group_size > 1 else ("sample", self.sample_id)


@dataclass(slots=True, eq=False)
class Entry:
    sample_id: str
    group_key: GroupKey
    oldest_version: int
    ref: Any
    state: EntryState = EntryState.STAGED
    uses: int = 0  # times handed out and acked without being used up (uniform replay)
    trained: bool = False  # in a lease marked consumed (see index.py's docstring)


@dataclass(eq=False)
class Group:
    key: GroupKey
    size: int  # samples the group holds when complete (1 for a sample of its own)
    arrived: int = 0  # samples that ever arrived, including dropped and acked ones
    pending: int = 0  # members in PENDING
    members: dict[str, Entry] = field(default_factory=dict)
    closed: bool = False  # given up on the members still missing (expire_groups)

    @property

    def complete(self) -> bool:
        return self.closed or self.arrived >= self.size


@dataclass(frozen=True)
class PullSpec:
    """What a consumer asks for."""

    batch_size: int  # samples per batch
    whole_groups: bool = True  # only complete groups, never split
    policy: Policy = Policy.FIFO
    max_reuse: int = 1  # hand-outs per sample before it is used up (FIFO: 1)
    lease_timeout_s: float = 60.0
    consumer: str = ""  # who pulls (a trainer process: a new one replaces the one before)


@dataclass(eq=False)
class Lease:
    lease_id: str
    entries: list[Entry]  # groups contiguous
    deadline: float
    max_reuse: int
    consumed: bool = False  # trained on; held only until the trainer acks it after its checkpoint
    consumer: str = ""
