"""The images of a request, from the wire to the engine: decoded and checked (Pillow), hashed, made into the model's
patches once by the model folder's image processor, and their placeholder tokens expanded in the prompt. A part
carries its bytes, or a uri the server reads: a file under `images.file_root`, or a remote URL where
`images.allow_remote_urls` is set (the call waits for the fetch).

Each refusal is a CodecError (INVALID_ARGUMENT) naming the part (`images[i]`): the request fails, nothing of it
runs, and the server goes on serving.
"""

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from protos import common_pb2, rollout_pb2
from protos.codec import CodecError
from protos.sample import SampleImage
from rollout.engine.multimodal import ImageInput
from rollout.serve.config import ImageSettings


@dataclass(frozen=True)
class ReadImage:
    """One image part as the engine takes it, and as a sample records it."""

    image: ImageInput
    media_type: str
    num_tokens: int

    def sample_image(self) -> SampleImage:
        """What a sample records of it (its bytes included)."""
        image = self.image
        return SampleImage(image.hash, self.media_type, image.grid_thw, self.num_tokens, image.data)

    def ref(self) -> common_pb2.ImageRef:
        return common_pb2.ImageRef(sha256=self.image.hash, media_type=self.media_type,
                                   grid_thw=list(self.image.grid_thw), num_tokens=self.num_tokens)


class ImageReader:
    """Reads the image parts of requests for one model folder whose config.json has a vision tower."""

    def __init__(self, model: str, settings: ImageSettings):
        from transformers import AutoImageProcessor  # heavy: only for a vision-language model

        config = json.loads((Path(model) / "config.json").read_text())
        self.image_token_id = int(config["image_token_id"])
        self.vision_start_id, self.vision_end_id = int(config["vision_start_token_id"]), int(config["vision_end_token_id"])
        self.merge_size = int(config["vision_config"].get("spatial_merge_size", 2))
        self.processor = AutoImageProcessor.from_pretrained(model)
        self.settings = settings

    @staticmethod
    def for_model(model: str, settings: ImageSettings) -> "ImageReader | None":
        """The reader of a vision-language model folder; None for a text-only one (its requests may carry no images)."""
        config = Path(model) / "config.json"
        if not config.exists() or "vision_config" not in json.loads(config.read_text()):
            return None
        return ImageReader(model, settings)

    def read(self, parts: list[rollout_pb2.ImagePart]) -> list[ReadImage]:
        if len(parts) > self.settings.max_images:
            raise CodecError(f"images: {len(parts)} images exceed max_images={self.settings.max_images}")
        return [self._read(part, f"images[{i}]") for i, part in enumerate(parts)]

    def _read(self, part: rollout_pb2.ImagePart, where: str) -> ReadImage:
        from PIL import Image, UnidentifiedImageError

        data = self._bytes(part, where)
        digest = hashlib.sha256(data).digest()
        if part.sha256 and part.sha256 != digest:
            raise CodecError(f"{where}.sha256: does not match the SHA-256 of its data ({digest.hex()[:16]}...)")
        try:
            image = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as exc:
            raise CodecError(f"{where}: not an image Pillow can decode ({len(data)} bytes): {exc}") from None
        width, height = image.size
        if width * height > self.settings.max_image_pixels:
            raise CodecError(f"{where}: {width} x {height} = {width * height} pixels exceed max_image_pixels="
                             f"{self.settings.max_image_pixels}")
        media_type = Image.MIME.get(image.format or "", "")
        if part.media_type and part.media_type != media_type:
            raise CodecError(f"{where}.media_type: {part.media_type!r}, but the bytes are {media_type or image.format}")
        try:
            rgb = image.convert("RGB")  # decodes the whole image: a truncated file fails here
        except (OSError, ValueError) as exc:
            raise CodecError(f"{where}: the image does not decode: {exc}") from None
        processed = self.processor(images=[rgb], return_tensors="pt")
        grid = tuple(int(n) for n in processed["image_grid_thw"][0])
        read = ImageInput(processed["pixel_values"], grid, digest, data, media_type)
        return ReadImage(read, media_type, read.num_tokens(self.merge_size))

    def _bytes(self, part: rollout_pb2.ImagePart, where: str) -> bytes:
        """The part's encoded image: inline, or read from its uri (a file under images.file_root, or a remote URL
        where allowed)."""
        if not part.uri:
            return part.data
        if part.data:
            raise CodecError(f"{where}: give data or uri, not both")
        scheme = urlsplit(part.uri).scheme
        if scheme == "file":
            return self._read_file(part.uri, f"{where}.uri")
        if scheme in ("http", "https"):
            return self._fetch(part.uri, f"{where}.uri")
        raise CodecError(f"{where}.uri: {scheme or 'a relative'!r} URIs are not served: give the bytes, a file:// path "
                         "under images.file_root, or an http(s):// URL where images.allow_remote_urls is set")

    def _read_file(self, uri: str, where: str) -> bytes:
        url = urlsplit(uri)
        if self.settings.file_root is None:
            raise CodecError(f"{where}: file:// images are refused here (the server sets no images.file_root)")
        if url.netloc not in ("", "localhost"):
            raise CodecError(f"{where}: a file:// URI names no host but this one, got {url.netloc!r}")
        root = Path(self.settings.file_root).resolve()
        path = Path(unquote(url.path)).resolve()  # symlinks and `..` resolved: the file it really is
        if not path.is_relative_to(root):
            raise CodecError(f"{where}: {unquote(url.path)} is outside images.file_root ({root})")
        if not path.is_file():
            raise CodecError(f"{where}: no file {unquote(url.path)} under images.file_root")
        size = path.stat().st_size
        if size > self.settings.max_image_bytes:
            raise CodecError(f"{where}: {size} bytes exceed images.max_image_bytes={self.settings.max_image_bytes}")
        return path.read_bytes()

    def _fetch(self, uri: str, where: str) -> bytes:
        import urllib.error
        import urllib.request

        if not self.settings.allow_remote_urls:
            raise CodecError(f"{where}: remote image URLs are refused here (images.allow_remote_urls is false): send "
                             "the bytes")
        limit = self.settings.max_image_bytes
        try:
            with urllib.request.urlopen(uri, timeout=self.settings.remote_timeout_s) as reply:
                data = reply.read(limit + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise CodecError(f"{where}: fetching {uri[:80]} failed: {exc}") from None
        if len(data) > limit:
            raise CodecError(f"{where}: over images.max_image_bytes={limit} bytes")
        return data

    def expand(self, prompt: list[int], images: list[ReadImage]) -> list[int]:
        """`prompt` with each run of the image token that is one token long made as long as its image's tokens (runs
        already that long are kept). The runs are checked against the images by the engine."""
        out: list[int] = []
        run = 0  # the index of the run the next image token starts
        for index, token in enumerate(prompt):
            starts = token == self.image_token_id and (index == 0 or prompt[index - 1] != token)
            single = starts and (index + 1 == len(prompt) or prompt[index + 1] != token)
            if single and run < len(images):
                out += [token] * images[run].num_tokens
            else:
                out.append(token)
            run += starts
        return out

    def placeholder(self, tokenizer) -> str:
        """The text an image is written as in a rendered chat prompt: vision start, one image token, vision end
        (`expand` makes the image token as long as the image)."""
        return "".join(tokenizer.convert_ids_to_tokens([self.vision_start_id, self.image_token_id, self.vision_end_id]))


def read_data_urls(reader: ImageReader | None, urls: list[str], engine: str) -> list[ReadImage]:
    """The images of OpenAI image_url parts: each a `data:<media type>;base64,<bytes>` URI, or a file:// or http(s)://
    URI read as an ImagePart's uri is (under images.file_root; remote where allowed); CodecError names the part
    (`images[i]`) as ImageReader.read does."""
    if reader is None or engine != "native":
        raise CodecError(f"images: this server ({engine} engine) takes no images: it serves a text-only model, or an "
                         "engine without image support yet")
    parts = []
    for i, url in enumerate(urls):
        if not url.startswith("data:"):
            parts.append(rollout_pb2.ImagePart(uri=url))
            continue
        head, comma, payload = url.partition(",")
        if not (comma and head.endswith(";base64")):
            raise CodecError(f"images[{i}]: a data: URI must carry base64 bytes (data:image/png;base64,...), "
                             f"got {url[:40]!r}")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise CodecError(f"images[{i}]: the data: URI's bytes are not base64 ({exc})") from None
        parts.append(rollout_pb2.ImagePart(data=data, media_type=head[len("data:"):-len(";base64")]))
    return reader.read(parts)
