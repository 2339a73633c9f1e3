"""Prometheus metrics of the replay buffer (rates come from the counters: rate(..._total[1m]))."""

from prometheus_client import Counter, Gauge, Histogram

SAMPLES = Gauge("relayrl_buffer_samples", "Samples held, by state (staged = awaiting fsync)", ["state"])
ACCEPTED = Counter("relayrl_buffer_accepted_samples_total", "Samples stored by Put")
ACCEPTED_BYTES = Counter("relayrl_buffer_accepted_bytes_total", "Serialized sample bytes stored by Put")
DUPLICATES = Counter("relayrl_buffer_duplicate_samples_total", "Samples ignored by Put: their id was stored")
REJECTED = Counter("relayrl_buffer_rejected_puts_total", "Put calls refused at capacity")
PULLED = Counter("relayrl_buffer_pulled_samples_total", "Samples handed out in leased batches")
ACKED = Counter("relayrl_buffer_acked_samples_total", "Samples acknowledged for good by a trainer")
REDELIVERED = Counter("relayrl_buffer_redelivered_samples_total", "Samples of expired leases, delivered again")
DROPPED = Counter("relayrl_buffer_dropped_samples_total", "Samples dropped, by reason", ["reason"])
IMAGES = Gauge("relayrl_buffer_images", "Images stored once by hash (referred to by held samples)")
IMAGE_BYTES_FREED = Counter("relayrl_buffer_image_bytes_freed_total", "Bytes of images deleted: no held sample "
                            "refers to them")
FSYNC_SECONDS = Histogram(
    "relayrl_buffer_fsync_seconds",
    "Duration of one log fsync",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
