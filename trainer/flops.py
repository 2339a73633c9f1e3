"""Utilisation: the FLOPs a training step does, the device's peak, and their ratio (MFU).

The count is the matmuls' (what dense peaks measure): every linear layer's 2 FLOPs per weight per token forward,
the attention scores and their weighted sum (2 x 2 x tokens x tokens x heads x head_dim per layer and row, the full
square, as SDPA computes it on padded rows), and twice the forward for the backward. Elementwise work, norms and
the softmax are left out, as MFU conventionally does; tests/test_stage_reports.py holds it to
`torch.utils.flop_counter.FlopCounterMode` within 10%. Peaks: a table of known accelerators' dense bf16 peaks; on the
CPU (or an accelerator not in the table) one measured by a matmul probe, once per process.
"""

import functools
import time

import torch
from torch import nn

# Dense (not 2:4 sparse) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets; the first name found in the
# device's name wins, so the more specific names come first.
PEAK_BF16 = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM and NVL
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
)


class FlopModel:
    """The matmul FLOPs of one forward + backward of a causal LM over a [rows, tokens] batch."""

    def __init__(self, lm: nn.Module, tp_size: int = 1) -> None:
        config = lm.config.get_text_config()  # a vision-language model: its language model's shape
        # Every linear weight, the output head included (a tied head shares the embedding's tensor: it is a matmul
        # here, while the embedding itself is a lookup). A vision tower's are left out: it runs on patches, not tokens.
        self.linear_params = sum(module.weight.numel() for name, module in lm.named_modules()
                                 if isinstance(module, nn.Linear) and ".visual." not in f".{name}.")
        self.layers = config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.attention_width = config.num_attention_heads * head_dim
        self.tp_size = tp_size  # tensor parallelism splits every matmul over the group: each rank does 1/tp

    def forward(self, rows: int, tokens: int) -> float:
        linear = 2.0 * self.linear_params * rows * tokens
        attention = 4.0 * self.layers * rows * tokens * tokens * self.attention_width
        return (linear + attention) / self.tp_size

    def train(self, rows: int, tokens: int) -> float:
        """Forward and backward (the backward's two matmuls per forward one: 2x)."""
        return 3.0 * self.forward(rows, tokens)


def device_peak(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) for `device`: the table's entry for its name, else a measured one."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16:
            if key in name:
                return peak, f"{name}: dense bf16 data-sheet peak"
    return measured_peak(device.type), f"{device.type}: float32 matmul probe"


@functools.cache
def measured_peak(device_type: str = "cpu", size: int = 512, repeats: int = 5) -> float:
    """The best FLOP/s of a size x size float32 matmul on this device, measured once per process."""
    device = torch.device(device_type)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2.0 * size**3 / best
