"""Shared fixtures: free ports, a tiny model folder, and real service processes."""

import os
import pathlib
import signal
import socket

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A suite started in the background of a non-interactive shell (`pytest ... &`, as scripts and agents do) inherits
# SIGINT ignored, and every process a test starts inherits that: the Ctrl-C tests (status --watch, relayrl run) then
# saw their signal ignored and failed, 4 of them in each such full run. Ctrl-C is what they test: restore it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread per test process, as in the product: CI has 2 cores and tests start
    service processes beside the test process."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny Qwen2 HF folder (hidden 128, 2 layers, head_dim 32, char tokenizer), made in code."""
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "qwen2", seed=0)


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir, tmp_path_factory) -> pathlib.Path:
    """The tiny model with its logits scaled 4x. A random model's next-token distribution is nearly uniform (top
    logprob ~ -4.0 of a vocabulary of 101), so any rounding flips its greedy ties; a trained model's is not.
    For tests of lossy KV (compression) that count greedy agreement."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharp-model") / "qwen2"
    shutil.copytree(tiny_model_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture
def service_factory(tmp_path):
    """start(name, overrides) -> ServiceProcess; every process started is stopped at teardown."""
    from deploy.local.service_process import start_service

    started = []

    def start(name: str, overrides: dict | None = None, **kwargs):
        kwargs.setdefault("log_dir", tmp_path / "logs")
        service = start_service(name, overrides, **kwargs)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop(timeout=10)
