"""The replay buffer service: durable, staleness-aware, group-aware storage between rollout and trainer.

store.py (in-memory index, policies, leases, staleness) <- buffer.py (over the durable log.py with
commit.py's fsync policy) <- service.py (the gRPC servicer and serve()).
"""
