"""What a run writes: its state and summary, provenance, progress, loggers, TensorBoard, the service registry, the status poller, the run record."""
