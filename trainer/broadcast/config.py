"""How the trainer publishes weights (BroadcastConfig): collective, bucket sizes, deadlines, rendezvous address."""

from typing import Literal

from pydantic import Field

from services.config import ClientConfig, Strict


class BroadcastConfig(Strict):
    """How the trainer publishes weights."""

    backend: Literal["gloo", "nccl", "cupy_nccl", "cuda_ipc"] = Field(
        "gloo", description="Collective for the tensors: gloo (CPU), nccl (GPU, torch's ProcessGroupNCCL) or cupy_nccl "
        "(GPU, cupy's NCCL bindings: the `gpu` extra). The NCCL ones need every member on a GPU of its own. "
        "cuda_ipc: CUDA IPC handles, every receiver on the trainer's GPU (chosen by itself when they are: cuda_ipc).")
    cuda_ipc: bool = Field(True, description="When every receiver of a group stages on this trainer's GPU, hand them "
                           "CUDA IPC handles of the buckets (they copy GPU to GPU) whatever `backend` says, instead of a "
                           "copy through host memory (gloo) or a refusal (NCCL: one GPU per member).")
    bucket_mb: float = Field(32.0, gt=0, description="Tensors are packed into buckets of up to this many MiB; "
                             "packing the next bucket overlaps sending this one. On gloo, 32-64 MiB beat smaller "
                             "buckets and one broadcast per tensor: each collective has a fixed cost in time and CPU.")
    solo_mb: float | None = Field(None, ge=0, description="Tensors of this many MiB or more travel alone, straight "
                                  "from their memory (no packing copy); None = bucket_mb.")
    timeout_s: float = Field(60.0, gt=0, description="Deadline of rendezvous + transfer, and of every collective.")
    control_timeout_s: float = Field(10.0, gt=0, description="Deadline of each BeginUpdate/AbortUpdate call, and "
                                     "what CommitUpdate may add for the switch itself.")
    master_addr: str = Field("127.0.0.1", description="Address at which receivers reach this trainer's rendezvous store "
                             "and gloo group; both bind this interface only (loopback: unreachable from other hosts).")
    master_port: int = Field(0, ge=0, le=65535, description="Port of the rendezvous store; 0 = any free port.")
    keep_group: bool = Field(True, description="Reuse the group across publishes while its members are unchanged.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Cast floating tensors to this dtype before sending (the rollout engine's); None = as is."
    )
    delta: Literal["auto", "off"] = Field(
        "off", description="auto: once every receiver holds the last version, send each bucket as the words that "
        "changed since it (positions and values, bit for bit in the sent dtype), or whole when that is smaller, checked "
        "by a checksum per bucket (trainer/broadcast/delta.py); a receiver that lacks the base gets the whole version. "
        "Keeps two packed copies of the model on the trainer. off: every version whole.")
    adapter: bool = Field(
        False, description="The tensors are a frozen base plus LoRA adapters (trainer/broadcast/adapter.py): the base "
        "goes once, then each version as its adapter buckets alone, a partial update on the last version every "
        "receiver took; a receiver that lacks it gets the whole version. Takes the place of `delta`.")
    client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the receivers.")

    @property
    def publish_bound_s(self) -> float:
        """The longest one publish can take, whatever its receivers do: two Begin rounds, rendezvous +
        transfer, commit and aborts, each within its own deadline."""
        return 2 * self.timeout_s + 8 * self.control_timeout_s
