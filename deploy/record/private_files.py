"""Files of a run that only its owner reads (its secrets, the run's experiment file) and RUN_DIR/clients.json, how
the run's own clients reach each service (paths, never a token): written by deploy/local/security.py, read by
`relayrl status RUN_DIR` (deploy/record/status.py)."""

import json
import os
import pathlib

from services.config import ClientConfig

CLIENTS_FILE = "clients.json"


def read_clients(run_dir: pathlib.Path) -> dict[str, ClientConfig]:
    """How the run in `run_dir` reaches each service kind (none recorded: plain text, no token)."""
    path = run_dir / CLIENTS_FILE
    if not path.exists():
        return {}
    return {kind: ClientConfig(**fields) for kind, fields in json.loads(path.read_text()).items()}


def write_private(path: pathlib.Path, text: str, private_folder: bool = True) -> None:
    """`text` in a file only its owner can read (with `private_folder`, in a folder only its owner can list)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if private_folder:
        os.chmod(path.parent, 0o700)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
