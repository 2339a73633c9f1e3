"""Weight sync shared by trainer and rollout: the manifest and bucket layout (manifest.py, buckets.py),
the process group that carries the bytes (the interface in transfer.py, one backend each in gloo.py / nccl.py /
cupy_nccl.py, picked by backends.py; torch_group.py for members that form it as torch.distributed does, SGLang's
scheduler), the bucket stream, and partial updates (delta.py: a version as a change of its base, checksummed)."""

from services.weights.backends import make_group
from services.weights.bucket_stream import (
    BucketSender,
    BucketSource,
    allocate_staging,
    bind_to_buckets,
    receive_buckets,
    send_buckets,
    send_tensors,
)
from services.weights.buckets import pack_bucket, unpack_bucket, unpack_buckets
from services.weights.manifest import Manifest, TensorSlot, merge_order, plan_buckets
from services.weights.transfer import (
    GroupSpec,
    Transfer,
    TransferError,
    TransferTimeout,
    deadline_after,
    host_store,
    transfer_device,
)

__all__ = [
    "BucketSender", "BucketSource", "GroupSpec", "Manifest", "TensorSlot", "Transfer", "TransferError", "TransferTimeout",
    "allocate_staging", "bind_to_buckets", "deadline_after", "host_store", "make_group", "merge_order", "pack_bucket", "plan_buckets",
    "receive_buckets", "send_buckets", "send_tensors", "transfer_device", "unpack_bucket", "unpack_buckets",
]
