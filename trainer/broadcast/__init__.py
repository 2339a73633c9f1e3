"""Publishing versioned weights from the trainer to rollout workers.

config.py: BroadcastConfig. plan.py: which tensors a publish sends and how they lie in buckets (the manifest).
transport.py: the process group that carries them (rendezvous store, group kept across publishes, sending).
broadcaster.py: the protocol over gRPC (Begin, transfer, Commit, Abort) and the PublishReport; blocking.py:
the same for a synchronous training loop.
"""
