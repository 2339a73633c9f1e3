"""Publishing versioned weights from the trainer to rollout workers.

config.py: BroadcastConfig. plan.py: which tensors a publish sends and how they lie in buckets (the manifest).
gather.py: a sharded policy (FSDP2) gathered on the device straight into each bucket as it goes out.
transport.py: the process group that carries them (rendezvous store, group kept across publishes, sending).
broadcaster.py: the protocol over gRPC (Begin, transfer, Commit, Abort); report.py: what a publish did (PublishReport);
blocking.py: the same for a synchronous training loop. delta.py, adapter.py: partial versions (deltas, LoRA adapters).
senders.py: several senders of one version (pipeline stages, each its own layers; sender 0 runs the protocol).
"""
