"""Utilisation: the FLOPs a training step or an engine step does, the device's peak, and their ratio (MFU).

One FLOP model for the trainer (trainer/stages.py) and the rollout engine (rollout/engine/step_stats.py), so their
MFUs compare. The count is the matmuls' (what dense peaks measure): every linear layer's 2 FLOPs per weight per
token forward, the attention scores and their weighted sum (2 x 2 x context x heads x head_dim per layer and
computed token: a training row attends over the full square, as SDPA computes it on padded rows; an engine token over
its cached context), and twice the forward for the backward. Elementwise work, norms and
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
    """The matmul FLOPs of a causal LM's forward (and forward + backward) passes."""

    def __init__(self, linear_params: int, layers: int, attention_width: int, tp_size: int = 1) -> None:
        self.linear_params = linear_params  # weights multiplied per token (the output head included)
        self.layers = layers
        self.attention_width = attention_width  # query heads x head_dim
        self.tp_size = tp_size  # tensor parallelism splits every matmul over the group: each rank does 1/tp

    @classmethod
    def of_module(cls, lm: nn.Module, tp_size: int = 1) -> "FlopModel":
        """Of a transformers model (the trainer's): its nn.Linear weights, its text config's shape."""
        config = lm.config.get_text_config()  # a vision-language model: its language model's shape
        # Every linear weight, the output head included (a tied head shares the embedding's tensor: it is a matmul
        # here, while the embedding itself is a lookup). A vision tower's are left out: it runs on patches, not tokens.
        linear_params = sum(module.weight.numel() for name, module in lm.named_modules()
                            if isinstance(module, nn.Linear) and ".visual." not in f".{name}.")
        return cls(linear_params, config.num_hidden_layers, attention_width(config), tp_size)

    def tokens(self, computed: int, attended: int) -> float:
        """A forward over `computed` tokens that attend over `attended` (token, context position) pairs in all."""
        return (2.0 * self.linear_params * computed + 4.0 * self.layers * attended * self.attention_width) / self.tp_size

    def forward(self, rows: int, tokens: int) -> float:
        """A [rows, tokens] batch, every row attending over its full square (SDPA on padded rows)."""
        return self.tokens(rows * tokens, rows * tokens * tokens)

    def train(self, rows: int, tokens: int) -> float:
        """Forward and backward (the backward's two matmuls per forward one: 2x)."""
        return 3.0 * self.forward(rows, tokens)


def attention_width(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim


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
