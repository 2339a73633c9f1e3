"""`relayrl sweep`: a study over an experiment file's settings, its trials, config and report."""
