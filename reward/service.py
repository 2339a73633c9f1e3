"""The reward gRPC service (`relayrl serve reward`): a thin servicer over reward.scorer."""

import grpc
from pydantic import Field, model_validator

from protos import reward_pb2, reward_pb2_grpc
from protos.codec import CodecError, unpack_metadata
from protos.sample import Sample
from reward.judge import Judge, JudgeConfig
from reward.registry import BUILTINS, DOTTED_PATTERN, BadFunction, Registry, RewardSpec, UnknownFunction
from reward.scorer import FunctionUnavailable, Scorer, ScorerSettings, check_timeout
from reward.stage_report import ScoringClock
from services.config import ServerConfig, Strict
from services.runtime import serve as run_server

SERVICE_NAME = "relayrl.reward.v1.Reward"


class FunctionConfig(Strict):
    """A reward function added by the operator under a name of its own."""

    target: str = Field(pattern=DOTTED_PATTERN, description="'package.module:function', importable by the server.")
    batched: bool = Field(False, description="The function takes the list of samples (like a reward model).")
    args: dict[str, object] = Field(default_factory=dict, description="Arguments fixed for every call.")


class RewardModelConfig(Strict):
    """A sequence-classification reward model served under a function name."""

    path: str = Field(description="Local Hugging Face folder (config.json, weights, tokenizer).")
    batch_size: int = Field(8, gt=0, description="Samples per forward pass.")
    max_length: int = Field(1024, gt=0, description="Tokens per text; longer ones keep their end.")
    label: int = Field(-1, description="With several labels, the one whose probability is the score.")
    device: str = Field("cpu", description="torch device, e.g. 'cpu' or 'cuda:0'.")


class Config(Strict):
    """The reward service."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    default_timeout_s: float = Field(30.0, gt=0, description="Per-sample timeout when a request gives 0.")
    max_timeout_s: float = Field(600.0, gt=0, description="Largest per-sample timeout a request may ask for.")
    max_concurrency: int = Field(2, gt=0, description="Samples scored at once (one worker process each).")
    model_workers: int = Field(1, gt=0, description="Worker processes for batched functions (reward models).")
    threads_per_worker: int = Field(1, gt=0, description="torch/OpenMP threads per worker process.")
    batch_chunk: int = Field(64, gt=0, description="Samples per call to a batched function (one timeout each).")
    max_batch_samples: int = Field(16384, gt=0, description="Most samples one Score request may carry.")
    load_timeout_s: float = Field(120.0, gt=0, description="Time a worker may take to import a function and "
                                  "prepare it (load a reward model).")
    inline_max_chars: int = Field(4096, ge=0, description="Built-ins marked inline (exact/numeric match) score "
                                  "responses up to this many characters in the server process, without a worker "
                                  "round trip; longer ones go to workers. 0 = always in workers.")
    allow_custom: bool = Field(False, description="Let requests name any importable 'package.module:function'.")
    functions: dict[str, FunctionConfig] = Field(default_factory=dict, description="Extra named functions.")
    reward_models: dict[str, RewardModelConfig] = Field(
        default_factory=dict, description="name -> reward model; requests call it as function `name`.")
    judges: dict[str, JudgeConfig] = Field(
        default_factory=dict, description="name -> an LLM served elsewhere (OpenAI-compatible) that grades each "
        "completion; requests call it as function `name` (reward/judge.py).")

    @model_validator(mode="after")
    def _judge_requests_fit_a_sample(self) -> "Config":
        for name, judge in self.judges.items():
            if judge.timeout_s >= self.default_timeout_s:
                raise ValueError(f"judges.{name}.timeout_s ({judge.timeout_s:g}s per request) must be below "
                                 f"default_timeout_s ({self.default_timeout_s:g}s per sample, retries included)")
        return self


def build_registry(config: Config) -> Registry:
    """Built-ins plus the operator's functions and reward models."""
    registry = Registry(BUILTINS)
    for name, fn in config.functions.items():
        registry.add(RewardSpec(name, fn.target, fn.batched, dict(fn.args)))
    for name, model in config.reward_models.items():
        registry.add(RewardSpec(name, "reward.model:reward_model", batched=True, bound_args=model.model_dump(),
                                prepare="reward.model:prepare"))
    for name, judge in config.judges.items():  # scored in the server's loop (Scorer.judges), never imported
        registry.add(RewardSpec(name, "reward.judge:Judge", bound_args=judge.model_dump()))
    return registry


def decode_samples(request: reward_pb2.ScoreRequest) -> list[Sample]:
    samples = []
    for i, msg in enumerate(request.samples):
        try:
            samples.append(Sample.from_proto(msg))
        except CodecError as exc:
            raise CodecError(f"samples[{i}].{exc}") from None
    return samples


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """proto <-> scorer; every request-level problem becomes a status, never a crash."""

    def __init__(self, scorer: Scorer, config: Config):
        self.scorer, self.config = scorer, config
        self.clock = ScoringClock()  # the stage report (reward/stage_report.py)

    async def Score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext):
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if len(request.samples) > self.config.max_batch_samples:
            await context.abort(invalid, f"samples: {len(request.samples)} exceed the limit of "
                                         f"{self.config.max_batch_samples} per request")
        if not request.function:
            await context.abort(invalid, "function: required (see ListFunctions)")
        try:
            timeout_s = check_timeout(request.timeout_s, self.config.default_timeout_s, self.config.max_timeout_s)
            spec = self.scorer.resolve(request.function)
        except (ValueError, UnknownFunction) as exc:
            await context.abort(invalid, str(exc))
        args = unpack_metadata(request.function_args, field="function_args")
        if any(not isinstance(key, str) for key in args):
            await context.abort(invalid, "function_args: keys must be strings")
        samples = decode_samples(request)
        try:
            args = await self.scorer.check(spec, args)
        except BadFunction as exc:
            await context.abort(invalid, str(exc))
        except FunctionUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        with self.clock.call(len(samples)):
            outcomes = await self.scorer.score(samples, spec, args, timeout_s)
        return reward_pb2.ScoreResponse(results=[
            reward_pb2.ScoreResult(sample_id=sample.sample_id, reward=outcome.reward, details=outcome.details,
                                   status=int(outcome.status),
                                   reason=outcome.reason)
            for sample, outcome in zip(samples, outcomes)
        ])

    async def ListFunctions(self, request: reward_pb2.ListFunctionsRequest, context: grpc.aio.ServicerContext):
        return reward_pb2.ListFunctionsResponse(names=self.scorer.registry.names())


async def serve(config: Config) -> None:
    """Start the worker processes, serve until SIGTERM, then stop the workers."""
    settings = ScorerSettings(
        max_concurrency=config.max_concurrency, model_workers=config.model_workers,
        threads_per_worker=config.threads_per_worker, batch_chunk=config.batch_chunk,
        load_timeout_s=config.load_timeout_s, inline_max_chars=config.inline_max_chars,
    )
    judges = {name: Judge(name, judge) for name, judge in config.judges.items()}
    scorer = Scorer(build_registry(config), settings, allow_custom=config.allow_custom, judges=judges)
    scorer.start()
    servicer = RewardServicer(scorer, config)
    try:
        await run_server("reward", [(reward_pb2_grpc.add_RewardServicer_to_server, servicer, SERVICE_NAME)],
                         config.server, stage_report=servicer.clock.report)
    finally:
        scorer.close()
        for judge in judges.values():
            await judge.close()
