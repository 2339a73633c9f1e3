"""The replay buffer's settings (the service's Config adds `server`)."""

from typing import Literal

from pydantic import Field

from services.config import Strict


class BufferConfig(Strict):
    """What the buffer holds, how durably, and how it hands samples out."""

    data_dir: str = Field(description="Directory of the durable log (created if missing; reopened on restart).")
    capacity: int = Field(65_536, gt=0, description="Most samples held (written + pending + leased); Put beyond it "
                          "gets back-pressure.")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop a sample once trainer_version - its oldest token version exceeds this; "
        "None = never (0 = strictly on-policy).")
    fsync: Literal["always", "batch", "never"] = Field(
        "batch", description="When a Put or Ack is durable: 'batch' after a group-commit fsync shared by the calls "
        "of one window, 'always' after an fsync started as soon as a call waits, 'never' once written to the OS "
        "(survives a killed process, not a machine crash).")
    fsync_window_ms: float = Field(2.0, ge=0, description="Group commit: wait this long after the first "
                                   "waiting call before the shared fsync ('batch' only).")
    segment_bytes: int = Field(32 << 20, ge=4096, description="Roll over to a new log segment past this size; "
                               "old segments are compacted then (see compact_live_ratio).")
    compact_live_ratio: float = Field(
        0.5, gt=0, lt=1, description="Compaction deletes a sealed segment once at most this share of it is live "
        "(held samples, and 8 bytes per id ever stored, copied forward first), and older ones too while the log "
        "exceeds live bytes / this + 2 segments (sparing the segment sealed last): the log stays under about "
        "that + 2 segments.")
    incomplete_group_timeout_s: float = Field(
        600.0, gt=0, description="A group still missing members this long after its first one arrived is closed: "
        "its held members are dropped ('incomplete_group'); a member arriving for a closed, complete or finished "
        "group is dropped at once ('late_member'). Counted from the arrival this process saw (a restart waits anew).")
    lease_timeout_s: float = Field(60.0, gt=0, description="Default time a pulled batch may stay unacked before "
                                   "its samples are delivered again.")
    max_reuse: int = Field(4, ge=1, description="Default hand-outs per sample under uniform replay.")
    max_unacked: int = Field(4, ge=1, description="Default prefetch of a Pull stream: batches leased and not "
                             "yet acked before the stream waits for an Ack.")
    backpressure: Literal["reject", "block"] = Field(
        "reject", description="At capacity: 'reject' answers RESOURCE_EXHAUSTED, 'block' holds the call (and a "
        "client stream) until room frees up or block_timeout_s passes.")
    block_timeout_s: float = Field(30.0, gt=0, description="Longest a blocked Put waits for room.")
    images_by_hash: bool = Field(
        True, description="Store each image of the samples once, by its SHA-256, in <data_dir>/images (a sample's "
        "record keeps its refs; handed out, it gets the bytes back inline), freed once no held sample refers to it "
        "(services/buffer/images.py). False: each sample's record keeps its images' bytes.")
    seed: int | None = Field(None, description="Seed of uniform replay's random picks (None: from the OS).")
    canonical_order: bool = Field(
        False, description="Hand out ready groups in an order that does not depend on when they arrived: groups "
        "trained before first, then by oldest weight version, then by group id, each group's samples by id "
        "(a deterministic run, deploy/experiment/schema.py). False: in order of arrival.")
