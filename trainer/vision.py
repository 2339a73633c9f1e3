"""A vision-language policy's image inputs for a batch: each sample's images made into patches again from their
bytes, at the patch grid the rollout recorded (protos.sample.SampleImage), so the trainer sees the pixels the rollout
engine saw and never re-derives them under other pixel limits."""

import io
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from protos.sample import SampleImage


class VisionInputs:
    """Builds the forward's image arguments (pixel_values, image_grid_thw, mm_token_type_ids) for one model folder."""

    def __init__(self, model: str | Path):
        from transformers import AutoImageProcessor  # heavy: only for a vision-language policy

        config = json.loads((Path(model) / "config.json").read_text())
        self.image_token_id = int(config["image_token_id"])
        self.processor = AutoImageProcessor.from_pretrained(model)
        self.patch_size = self.processor.patch_size

    @staticmethod
    def for_model(model: str | Path) -> "VisionInputs | None":
        """The builder of a folder whose config.json has a vision tower; None for a text-only model."""
        return VisionInputs(model) if "vision_config" in json.loads((Path(model) / "config.json").read_text()) else None

    def __call__(self, images: Sequence[Sequence[SampleImage]], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The image arguments of a batch whose row i holds the prompt of a sample with images[i] (in prompt order);
        {} when no sample has an image. ValueError names an image whose recorded grid cannot be made again."""
        from PIL import Image

        pixels, grids = [], []
        for row, row_images in enumerate(images):
            for index, image in enumerate(row_images):
                _, h, w = image.grid_thw
                area = h * w * self.patch_size**2  # the resized image's pixels: made exactly, whatever the limits
                decoded = Image.open(io.BytesIO(image.data)).convert("RGB")
                processed = self.processor(images=[decoded], size={"shortest_edge": area, "longest_edge": area},
                                           return_tensors="pt")
                grid = tuple(int(n) for n in processed["image_grid_thw"][0])
                if grid != tuple(image.grid_thw):
                    raise ValueError(f"sample {row} images[{index}]: the processor makes grid {list(grid)} of its "
                                     f"bytes, the rollout recorded {list(image.grid_thw)}")
                pixels.append(processed["pixel_values"])
                grids.append(grid)
        if not pixels:
            return {}
        return {"pixel_values": torch.cat(pixels).to(input_ids.device),
                "image_grid_thw": torch.tensor(grids, device=input_ids.device),
                "mm_token_type_ids": (input_ids == self.image_token_id).int()}
