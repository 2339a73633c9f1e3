"""Learning: algorithms and losses, the buffer client, FSDP2 data parallelism, checkpoints.

Pure tensor math lives in losses.py / advantages.py / objectives.py; batch.py pads samples;
model.py wraps the Hugging Face policy; parallel.py composes torch.distributed and FSDP2;
learner.py prepares batches of any size and takes optimizer steps; loop.py pulls, trains, publishes,
checkpoints and acks; leases.py keeps leases open and ties acks to checkpoints (exactly once across a
crash); broadcast/ publishes versioned weights to the rollout workers; config/ holds the typed config, a
module per section; `python -m trainer` (run.py) wires one process, also under torchrun.
"""
