"""Held-out evaluation through the running services: greedy completions from the rollout (the weights it serves
right now), scored by the reward service or compared to reference answers."""

import asyncio
import time

_RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


async def _retried(call, request, retry_for_s: float, check=None):
    """A call retried on UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED for up to `retry_for_s`: a service
    that restarts (or is frozen and then restarted) is waited for. `check` (deploy.local.supervisor.Supervisor.check) is
    called at each failed call: a run that failed (its service kept dying) raises its RunFailed, naming the cause,
    instead of being waited for."""
    import grpc

    give_up = time.monotonic() + retry_for_s
    while True:
        try:
            return await call(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            if check is not None:
                check()
            if exc.code().name not in _RETRYABLE or time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.5)


async def greedy_completions(address: str, prompts: list[list[int]], max_tokens: int, per_call: int = 64,
                             retry_for_s: float = 300.0, client=None, check=None,
                             images: list[list[bytes]] | None = None) -> list:
    """One greedy completion (rollout_pb2.Completion) per prompt, `per_call` prompts per GenerateMany call, one
    call at a time: a round trip per chunk, not per prompt. `client`: how to reach the rollout (TLS, token);
    `check`: as _retried's; `images`: each prompt's encoded images (a vision-language model), else none."""
    from protos import rollout_pb2, rollout_pb2_grpc
    from protos.codec import encode_array
    from services.client import connect

    completions = []
    async with connect(address, client) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for start in range(0, len(prompts), per_call):
            chunk_images = (images or [[]] * len(prompts))[start:start + per_call]
            request = rollout_pb2.GenerateManyRequest(requests=[rollout_pb2.GenerateRequest(
                prompt_ids=encode_array(ids, "int32"),
                params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1),
                images=[rollout_pb2.ImagePart(data=data) for data in prompt_images])
                for ids, prompt_images in zip(prompts[start:start + per_call], chunk_images, strict=True)])
            reply = await _retried(stub.GenerateMany, request, retry_for_s, check)
            completions.extend(response.completions[0] for response in reply.responses)
    return completions


async def mean_reward(rollout: str, reward: str, prompts: list[tuple[list[int], str, dict]], max_tokens: int,
                      function: str, timeout_s: float, retry_for_s: float = 300.0, rollout_client=None,
                      reward_client=None, check=None, images: list[list[bytes]] | None = None) -> float:
    """Mean reward of greedy completions of (prompt ids, prompt text, metadata), scored by `function` on the
    reward service (`images`: each prompt's encoded images, as greedy_completions'); a sample the reward fails
    counts 0. The clients (services.config.ClientConfig) say how to
    reach the rollout and the reward (TLS, token); `check`: as _retried's."""
    import numpy as np

    from protos import reward_pb2, reward_pb2_grpc
    from protos.codec import decode_array
    from protos.sample import Sample
    from services.client import connect

    completions = await greedy_completions(rollout, [ids for ids, _, _ in prompts], max_tokens,
                                           retry_for_s=retry_for_s, client=rollout_client, check=check,
                                           images=images)
    samples = []
    for index, ((ids, text, metadata), completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens = decode_array(completion.token_ids, "token_ids", "int32")
        samples.append(Sample(
            sample_id=f"eval/{index}", prompt_id=f"eval/{index}", prompt_ids=np.asarray(ids, np.int32),
            response_ids=tokens, loss_mask=np.ones(tokens.size, np.uint8),
            rollout_logprobs=np.zeros(tokens.size, np.float32), weight_versions=np.zeros(tokens.size, np.int64),
            prompt_text=text, response_text=completion.text, metadata=metadata,
        ).to_proto())
    async with connect(reward, reward_client) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        reply = await _retried(stub.Score, reward_pb2.ScoreRequest(samples=samples, function=function,
                                                                   timeout_s=timeout_s), retry_for_s, check)
    return sum(result.reward for result in reply.results) / max(len(samples), 1)
