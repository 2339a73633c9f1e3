"""Environments for agentic RL: episodes played turn by turn against the rollout service's sessions."""
