"""The RL phase: its config and plan, the pipeline that runs it, evaluation."""
