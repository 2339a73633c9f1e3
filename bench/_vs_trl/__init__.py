"""The parts of bench/vs_trl.py: the shared task and evaluator, the warm start, and each side's runner."""
