"""Images in a prompt: what the engine takes per image, and the per-request state a vision-language model needs.

A request's images arrive preprocessed (the model folder's image processor made `pixel_values` and the grid), each
with a content hash. The prompt holds one run of the image placeholder token per image, as long as the image has
tokens (grid_t * grid_h * grid_w / merge**2). `MultimodalPrompt` keeps, per request, the 3-D M-RoPE position of
every prompt token (transformers' Qwen2_5_VLModel.get_rope_index for images), the offset tokens after the prompt
add to their index (`rope_delta`), and the tower's embeddings while the prefill still needs them.
"""

from dataclasses import dataclass, field
from functools import cached_property
from hashlib import blake2b

import torch

from rollout.config import ModelConfig
from rollout.engine.errors import InvalidRequest


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, as the image processor made it."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch], float
    grid_thw: tuple[int, int, int]  # patches along time, height and width
    hash: bytes  # content hash of the image (the same image always hashes the same): the prefix cache's key
    # The encoded image and its media type, kept for the sample a session's episode becomes (the service's)
    data: bytes = field(default=b"", repr=False)
    media_type: str = ""

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


@dataclass
class MultimodalPrompt:
    """The images of one request and the positions they give its prompt (shared by its n completions)."""

    images: list[ImageInput]
    positions: torch.Tensor  # [3, prompt tokens] int64: temporal, height, width position of each prompt token
    rope_delta: int  # a token at index p >= len(prompt) sits at position p + rope_delta on every axis
    image_rows: torch.Tensor  # [image tokens] int64: prompt indices of the placeholder tokens, in order
    embeds: torch.Tensor | None = field(default=None, repr=False)  # [image tokens, hidden]; made at prefill

    @cached_property
    def cache_key(self) -> bytes:
        """What the prefix cache mixes into the first block's hash: the images' hashes in order."""
        return blake2b(b"".join(image.hash for image in self.images), digest_size=16).digest()

    def rope_positions(self, start: int, count: int) -> torch.Tensor:
        """[3, count] positions of the tokens at indices start .. start + count - 1."""
        prompt = self.positions.shape[1]
        head = self.positions[:, start : min(start + count, prompt)]
        first = min(max(start, prompt), start + count)
        tail = torch.arange(first, start + count) + self.rope_delta
        return torch.cat([head, tail.expand(3, -1)], dim=1)


def multimodal_prompt(prompt: list[int], images: list[ImageInput], image_token_id: int, merge_size: int,
                      before: MultimodalPrompt | None = None, start: int = 0) -> MultimodalPrompt:
    """The M-RoPE state of `prompt` whose runs of `image_token_id` from index `start` on are `images` in order, the
    tokens before `start` as `before` has them (None: text only): a text token advances the position by one on all
    three axes; an image's tokens sit on a (t, h, w) grid from the position where it starts, and the text after it
    resumes at that start + max(grid_h, grid_w) / merge. InvalidRequest when the runs and the images do not match
    (the field named is `images`)."""
    runs = []  # (start, length) of each run of placeholder tokens
    for index in range(start, len(prompt)):
        if prompt[index] == image_token_id:
            if runs and runs[-1][0] + runs[-1][1] == index:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((index, 1))
    if len(runs) != len(images):
        raise InvalidRequest("images", f"the tokens have {len(runs)} runs of image tokens, the request "
                                       f"{len(images)} images")
    columns = [before.rope_positions(0, start) if before is not None else torch.arange(start).expand(3, -1)]
    position, cursor = start + (before.rope_delta if before is not None else 0), start
    for i, ((run_start, length), image) in enumerate(zip(runs, images)):
        t, h, w = image.grid_thw
        if image.pixel_values.dim() != 2 or image.pixel_values.shape[0] != t * h * w:
            raise InvalidRequest(f"images[{i}]", f"pixel_values {list(image.pixel_values.shape)} are not one row per "
                                                 f"patch of its grid {list(image.grid_thw)}")
        if length != image.num_tokens(merge_size):
            raise InvalidRequest(f"images[{i}]", f"its grid {list(image.grid_thw)} makes "
                                                 f"{image.num_tokens(merge_size)} image tokens, the prompt has {length}")
        columns.append(torch.arange(position, position + run_start - cursor).expand(3, -1))
        position += run_start - cursor
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        columns.append(grid.reshape(3, -1) + position)
        position += max(h, w)
        cursor = run_start + length
    columns.append(torch.arange(position, position + len(prompt) - cursor).expand(3, -1))
    positions = torch.cat(columns, dim=1).to(torch.int64)
    rows = torch.tensor([index for run_start, length in runs for index in range(run_start, run_start + length)],
                        dtype=torch.int64)
    if before is not None:
        images, rows = before.images + list(images), torch.cat([before.image_rows, rows])
    return MultimodalPrompt(list(images), positions, position + len(prompt) - cursor - len(prompt), rows)


def prompt_images(config: ModelConfig, prompt: list[int], images: list[ImageInput],
                  before: MultimodalPrompt | None = None, start: int = 0) -> MultimodalPrompt | None:
    """The multimodal state of a request to a model of `config` (of a session whose tokens before `start` have state
    `before`, when appending to it); None for text only. InvalidRequest for images sent to a text-only model, or
    images that do not match the image tokens from `start` on."""
    vision = config.vision
    if vision is None:
        if images:
            raise InvalidRequest("images", f"the model ({config.model_type}) takes no images")
        return None
    if not images and vision.image_token_id not in prompt[start:]:
        return before
    return multimodal_prompt(prompt, list(images), vision.image_token_id, vision.spatial_merge_size, before, start)
