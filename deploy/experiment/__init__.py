"""The experiment file: its schema and sections, data, forms of run, placement, the tiny model and tasks, teachers, the SFT warm-up, the quickstart project."""
