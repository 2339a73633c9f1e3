"""A vision-language policy's image inputs for a batch: each sample's images made into patches again from their
bytes, at the patch grid the rollout recorded (protos.sample.SampleImage), so the trainer sees the pixels the rollout
engine saw and never re-derives them under other pixel limits."""

import io
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from protos.sample import SampleImage
from trainer.packing import PackedRows


class VisionInputs:
    """A vision-language policy's image arguments for one model folder: a batch's images as row tensors
    (TrainBatch.pixel_values / image_grids, sliced with its rows), and from those rows the forward's pixel_values,
    image_grid_thw and mm_token_type_ids."""

    def __init__(self, model: str | Path):
        from transformers import AutoImageProcessor  # heavy: only for a vision-language policy

        config = json.loads((Path(model) / "config.json").read_text())
        self.image_token_id = int(config["image_token_id"])
        self.processor = AutoImageProcessor.from_pretrained(model)
        self.patch_size, self.merge_size = self.processor.patch_size, self.processor.merge_size

    @staticmethod
    def for_model(model: str | Path) -> "VisionInputs | None":
        """The builder of a folder whose config.json has a vision tower; None for a text-only model."""
        return VisionInputs(model) if "vision_config" in json.loads((Path(model) / "config.json").read_text()) else None

    def batch_tensors(self, images: Sequence[Sequence[SampleImage]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's image patches and grids as tensors a TrainBatch slices with its rows: pixel_values [rows,
        patches, patch dim] and grids [rows, images, 3], zero-padded (a grid row of zeros is no image)."""
        made = [self._patches(row_images, row) for row, row_images in enumerate(images)]
        patches = max([sum(p.shape[0] for p in pixels) for pixels, _ in made] + [1])
        width = max([p.shape[1] for pixels, _ in made for p in pixels] + [1])
        count = max([len(grids) for _, grids in made] + [1])
        pixel_values = torch.zeros(len(images), patches, width)
        grids = torch.zeros(len(images), count, 3, dtype=torch.int64)
        for row, (pixels, row_grids) in enumerate(made):
            if pixels:
                joined = torch.cat(pixels)
                pixel_values[row, : joined.shape[0], : joined.shape[1]] = joined
                grids[row, : len(row_grids)] = torch.tensor(row_grids)
        return pixel_values, grids

    def from_batch(self, pixel_values: torch.Tensor, grids: torch.Tensor, input_ids: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
        """The forward's image arguments from batch_tensors' rows (as selected with the batch's rows)."""
        pixels, kept, counts = [], [], []
        for row in range(grids.shape[0]):
            offset, row_counts = 0, []
            for grid in grids[row]:
                patches = int(grid.prod())
                if patches:
                    pixels.append(pixel_values[row, offset : offset + patches])
                    kept.append(grid)
                    row_counts.append(patches // self.merge_size**2)
                    offset += patches
            counts.append(row_counts)
        if not pixels:
            return {}
        return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.stack(kept).to(input_ids.device),
                "mm_token_type_ids": self._image_runs(input_ids, counts).int()}

    def packed(self, base, rows: PackedRows, pixel_values: torch.Tensor, grids: torch.Tensor, input_ids: torch.Tensor,
               attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward's image arguments for `rows`, the right-padded `input_ids` [n, T] packed (`base`: the policy's
        Qwen2_5_VLModel; pixel_values, grids: batch_tensors' rows): each sample's 3-D positions computed on its own
        row and laid where its tokens lie, after the packed rows' restarting text positions (position_ids [4, R, L]:
        transformers' packed form for Qwen2.5-VL, whose first row tells where each sample starts); the image-token
        marks packed with the tokens; the images in the order their samples lie in the packed rows, the order the
        tower's rows are spliced in. {} without images."""
        images = self.from_batch(pixel_values, grids, input_ids)
        if not images:
            return {}
        length, width = rows.input_ids.shape[1], input_ids.shape[1]
        positions = rope_positions(base, input_ids, attention_mask, images["image_grid_thw"], images["mm_token_type_ids"])
        owner = [row for row in range(grids.shape[0]) for grid in grids[row] if int(grid.prod())]  # each image's sample
        first = rows.token_src % width == 0  # each sample's first token: where the sample starts in the packed rows
        start = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        start[rows.token_src[first] // width] = rows.token_dst[first]
        order = sorted(range(len(owner)), key=lambda image: (int(start[owner[image]]), image))
        patches = images["pixel_values"].split(images["image_grid_thw"].prod(-1).tolist())
        packed_positions = rows.pack_tokens(positions.permute(1, 2, 0), 0).T.reshape(3, -1, length)
        return {"pixel_values": torch.cat([patches[i] for i in order]), "image_grid_thw": images["image_grid_thw"][order],
                "mm_token_type_ids": rows.pack_tokens(images["mm_token_type_ids"], 0).view(-1, length),
                "position_ids": torch.cat([rows.position_ids[None], packed_positions.to(rows.position_ids.device)])}

    def _image_runs(self, input_ids: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Where each row's images sit: in order, the runs of the image token exactly as long as the next image's
        tokens (a sampled image-token id, a run of another length, stays text, as the rollout engine took it).
        ValueError names a row whose images are not all found."""
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, pending in enumerate(counts):
            tokens, start, found = input_ids[row].tolist(), 0, 0
            while start < len(tokens) and found < len(pending):
                end = start
                while end < len(tokens) and tokens[end] == self.image_token_id:
                    end += 1
                if end - start == pending[found] and end > start:
                    mask[row, start:end] = True
                    found += 1
                start = max(end, start + 1)
            if found < len(pending):
                raise ValueError(f"row {row}: {len(pending) - found} of its {len(pending)} images have no run of "
                                 f"{pending[found]} image tokens in its tokens")
        return mask

    def _patches(self, images: Sequence[SampleImage], row: int) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
        """The patches and grid of each image of sample `row`, made at its recorded grid."""
        from PIL import Image

        pixels, grids = [], []
        for index, image in enumerate(images):
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
        return pixels, grids


def embed_images(base, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                 mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """The input embeddings of a Qwen2.5-VL batch (`base`: its Qwen2_5_VLModel), the vision tower's rows spliced where
    `mm_token_type_ids` marks the images' tokens (the images in the rows' flattened order). Done here, not by
    transformers' forward, which takes every image-token id in the rows for an image's (a sampled one too) and refuses
    the count."""
    embeds = base.get_input_embeddings()(input_ids)
    features = torch.cat(base.get_image_features(pixel_values, image_grid_thw).pooler_output).to(embeds.dtype)
    return embeds.masked_scatter(mm_token_type_ids.bool().unsqueeze(-1), features)


def rope_positions(base, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor,
                   mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """[3, rows, T] M-RoPE positions of right-padded rows with images (transformers' get_rope_index)."""
    positions, _ = base.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, attention_mask=attention_mask)
    return positions
