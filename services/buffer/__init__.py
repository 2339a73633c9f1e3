"""The replay buffer service: durable, staleness-aware, group-aware storage between rollout and trainer.

entries.py (the index's data) <- index.py (held samples, groups, staleness) <- store.py (leases, policies)
<- buffer.py (ReplayBuffer over the durable log.py with commit.py's fsync policy; its parts intake.py,
handout.py, compaction.py with segments.py, recovery.py; images.py its images, once by hash; results.py what it
answers) <- service.py (the gRPC servicer and serve()).
"""
