"""The `publish:` section of the trainer config: where and how new weights go after training steps."""

from typing import Literal

from pydantic import Field, model_validator

from services.config import ClientConfig, Strict


class PublishConfig(Strict):
    """Where new weights go after training steps (trainer/broadcast/)."""

    receivers: list[str] = Field(default_factory=list, description="host:port of each rollout worker; empty = no publish.")
    receivers_from: str | None = Field(
        None, description="host:port of a rollout router (rollout/router/router.py): publish to the replicas it lists, asked "
        "before every publish, so replicas added or removed mid-run are followed (trainer/receivers.py); with "
        "receivers empty.")
    interval: int = Field(1, gt=0, description="Publish every this many optimizer steps.")
    overlap: bool = Field(
        False,
        description="Send the weights on a background thread while the next step computes (one publish in "
        "flight; the next one waits for it). The trainer stops waiting for the rollout to switch versions; the "
        "buffer's staleness bound still holds, by the versions the samples carry.",
    )
    bind: bool = Field(
        True,
        description="When the trainer holds its policy whole (one process, no dtype cast), keep the parameters in "
        "one buffer laid out as the broadcast, so a publish sends straight from their memory (overlapped: from one "
        "memcpy of it) instead of gathering a state dict and packing it into buckets.",
    )
    backend: Literal["auto", "gloo", "nccl", "cupy_nccl", "cuda_ipc"] = Field(
        "gloo", description="Collective that carries the tensors: gloo (CPU), or on GPUs nccl (torch's ProcessGroupNCCL) "
        "or cupy_nccl (cupy's NCCL, the `gpu` extra). The NCCL ones send from the trainer's GPU and need every rollout "
        "engine on a GPU of its own (not the trainer's). Rollout engines all on the trainer's GPU get CUDA IPC "
        "handles instead, whichever is set (see cuda_ipc); cuda_ipc names that explicitly. auto: the one for the "
        "trainer's device (services/device.py transfer_backend: nccl on CUDA, gloo elsewhere).")
    cuda_ipc: bool = Field(True, description="Hand rollout engines that all stage on the trainer's GPU CUDA IPC handles "
                           "of the buckets (a GPU-to-GPU copy each) instead of a copy through host memory.")
    master_addr: str = Field("127.0.0.1", description="Address of this trainer at which the receivers reach the "
                             "rendezvous store and group of each publish; bound on that interface only.")
    master_port: int = Field(0, ge=0, le=65535, description="Port of the rendezvous store; 0 = any free port.")
    client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the receivers (TLS, token).")
    bucket_mb: float = Field(32.0, gt=0, description="Bucket size of the broadcast in MiB.")
    timeout_s: float = Field(60.0, gt=0, description="Deadline of rendezvous + transfer of one publish.")
    control_timeout_s: float = Field(10.0, gt=0, description="Deadline of each control call to a receiver "
                                     "(BeginUpdate, AbortUpdate, GetWeightVersion): an unreachable one is reported "
                                     "after this long.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Cast floating tensors to the rollout engine's dtype before sending; None = as trained."
    )
    delta: Literal["auto", "off"] = Field(
        "off", description="auto: send each version as the words that changed since the last one every receiver took "
        "(bit for bit in the sent dtype: set `dtype` to the engine's), bucket by bucket, or whole when that is smaller, "
        "verified by a checksum per bucket; a receiver that missed a version, restarted or joined gets it whole (counted "
        "as delta_fallbacks). Costs two packed copies of the model in the trainer's memory. Not for sharded policies "
        "(FSDP2 gathers into the buckets as they go: those versions go whole). off: every version whole.")
    adapter_min_change: float = Field(
        1e-6, ge=0, description="A LoRA policy (model.lora): skip a step's publish when no adapter element, on any rank, "
        "moved by more than this since the last publish (decided by all ranks together); the step's version is then "
        "the last published one. 0 = publish whenever anything moved.")
    resync_s: float = Field(
        5.0, gt=0, description="While the trainer waits for a batch, check every this many seconds that every "
        "receiver serves the last published version; one serving an older one (a restarted rollout worker starts at "
        "its base weights) gets the weights again under the next version, so a restart never waits for a step.")
    versions_above: int = Field(
        0, ge=0, description="Weight versions up to this one were used earlier in the job by trainers whose record "
        "the buffer and the receivers may have lost (a whole job killed and resumed: deploy/rl/pipeline.py passes its "
        "step records' highest): the trainer continues above it, so a version never names two sets of weights.")

    @model_validator(mode="after")
    def _one_source(self):
        if self.receivers and self.receivers_from:
            raise ValueError("publish: give receivers or receivers_from (a router's replicas), not both")
        return self
