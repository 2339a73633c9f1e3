"""Runs across machines: the Ray launcher and the Kubernetes manifests."""
