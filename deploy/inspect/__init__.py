"""What reads a run: status and its table, the doctor, diagnose and its findings, the trajectory viewer, the placement table."""
