"""Mixture-of-experts policies in the trainer: routing replay (R3) and the routers' metrics."""
