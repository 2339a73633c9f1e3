"""What `relayrl serve rollout` is told when it serves an engine in its own process."""

from pydantic import Field

from rollout.engines.settings import EngineChoice, NativeSettings
from rollout.serve.openai_schema import OpenAISettings
from services.config import ClientConfig, ServerConfig, Strict


class ImageSettings(Strict):
    """Limits on the images of a request to a vision-language model (rollout/serve/images.py)."""

    max_image_pixels: int = Field(16_000_000, gt=0, description="The most pixels (width x height) an image may have "
                                  "before resizing; a bigger one is refused (INVALID_ARGUMENT naming the part).")
    max_images: int = Field(16, gt=0, description="The most images one request may carry.")
    file_root: str | None = Field(None, description="Folder whose files image parts may name (`uri: "
                                  "file:///...` under it; symlinks resolved first); None: file:// parts are refused.")
    allow_remote_urls: bool = Field(False, description="Fetch image parts given as http(s):// URIs (the call waits "
                                    "for the fetch); False: refused.")
    remote_timeout_s: float = Field(10.0, gt=0, description="Longest fetch of a remote image.")
    max_image_bytes: int = Field(32 << 20, gt=0, description="The most encoded bytes a file or remote image may have.")


class ReplicaConfig(Strict):
    """`relayrl serve rollout` serving an engine in this process (rollout/main.py adds the router's settings)."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    model: str = Field(description="Local Hugging Face model folder (config.json, *.safetensors, tokenizer).")
    engine: EngineChoice = Field(default_factory=NativeSettings, description="The engine that generates: "
                                 "{type: native | vllm | sglang, ...its settings} (rollout/engines/settings.py).")
    buffer: str | None = Field(None, description="Replay buffer address for CloseSession(submit=true); None: "
                               "submitting is FAILED_PRECONDITION.")
    buffer_client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the buffer.")
    buffer_timeout_s: float = Field(30.0, gt=0, description="How long CloseSession retries a buffer that is "
                                    "unavailable or full before it answers submitted=false.")
    openai: OpenAISettings | None = Field(None, description="The OpenAI-compatible HTTP endpoint over the same "
                                          "engine (rollout/serve/openai_api.py, docs/openai.md); None: off.")
    images: ImageSettings = Field(default_factory=ImageSettings, description="Limits on a request's images (a "
                                  "vision-language model; docs/multimodal.md).")
