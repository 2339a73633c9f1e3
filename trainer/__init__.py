"""Learning: algorithms and losses, the buffer client, FSDP2 data parallelism, checkpoints.

Pure tensor math lives in losses.py / advantages.py / objectives.py; batch.py pads samples;
model.py wraps the Hugging Face policy; parallel.py composes torch.distributed and FSDP2;
learner.py prepares batches and takes optimizer steps; loop.py pulls, trains, acks, publishes
and checkpoints; `python -m trainer` (run.py) wires one process, also under torchrun.
"""
