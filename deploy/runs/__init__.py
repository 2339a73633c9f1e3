"""The runs themselves: an experiment run (prompts, an environment's episodes, offline pairs), resume, the quickstart."""
