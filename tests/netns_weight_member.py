"""One member of a weight-update group, run inside a test host (tests/test_netns.py): rank 0 hosts the rendezvous
store on the trainer's address and broadcasts a tensor; the others join from their own hosts and print what they
received.

    python tests/netns_weight_member.py MASTER_ADDR PORT_FILE RANK WORLD
"""

import pathlib
import sys
import time

import torch

from services.weights import GroupSpec, host_store, make_group


def main(master_addr: str, port_file: str, rank: int, world: int) -> None:
    if rank == 0:
        store = host_store(master_addr, 30)
        pathlib.Path(port_file).write_text(str(store.port))
        group = make_group(GroupSpec("gloo", master_addr, store.port, world, 0, "netns"), 30, store)
        tensor = torch.arange(16, dtype=torch.float32)
    else:
        while not pathlib.Path(port_file).exists():
            time.sleep(0.05)
        port = int(pathlib.Path(port_file).read_text())
        group = make_group(GroupSpec("gloo", master_addr, port, world, rank, "netns"), 30)
        tensor = torch.zeros(16)
    group.broadcast(tensor).wait(time.monotonic() + 30)
    print(f"rank {rank} received {tensor.sum().item():.0f}", flush=True)
    group.close(5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
