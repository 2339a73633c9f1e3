"""A served LLM judge: the reward asks an OpenAI-compatible endpoint (vLLM, SGLang, relayrl's rollout) to grade.

The judge's prompt is `template` with {prompt}, {response} and {answer} (the sample's reference answer,
metadata[answer_key], "" when absent) filled in, sent as-is to POST {url}/completions (put the judge
model's chat markup in the template if it wants one). Two modes:

- logprob: one greedy token with its top-k alternatives; score = P(yes) / (P(yes) + P(no)) of that next
  token, where P(yes) sums the alternatives whose text, stripped and lower-cased, is `yes` (" Yes", "yes",
  ...). Deterministic, continuous, one forward pass.
- generate: the judge writes a verdict; the last match of `pattern` (its first group) is a number, scaled
  from `score_range` to [0, 1] and clipped.

A verdict that cannot be read (no number; neither yes nor no among the alternatives) scores 0 with
details["judge_unparsed"] = 1, counted in relayrl_reward_judge_unparsed_total. A judge that cannot be
reached, or refuses, raises JudgeError after its retries: the sample comes back FAILED with that message.
Judges run in the reward server's asyncio loop (they wait on the network, not the CPU), at most
`max_concurrency` samples in grading at once per judge; a sample's timeout counts from when it gets a slot.
"""

import asyncio
import math
import os
import re
from typing import Literal

import httpx
from pydantic import Field, field_validator, model_validator

from protos.sample import Sample
from reward.metrics import JUDGE_UNPARSED
from reward.registry import RewardOutput
from services.config import Strict

_PLACEHOLDER = re.compile(r"\{(prompt|response|answer)\}")
_MAX_NOTE = 300


class JudgeConfig(Strict):
    """An LLM served elsewhere that grades each completion."""

    url: str = Field(description="Base URL of the OpenAI-compatible API, e.g. 'http://127.0.0.1:8000/v1'.")
    model: str = Field(description="The `model` the endpoint serves (GET {url}/models lists it).")
    template: str = Field(description="The judge's prompt; {prompt}, {response} and {answer} are filled in "
                          "(other braces stay as written). Must hold {response}.")
    mode: Literal["logprob", "generate"] = Field("logprob", description="logprob: P(yes)/(P(yes)+P(no)) of the "
                                                 "next token; generate: a number read from a written verdict.")
    yes: str = Field("yes", min_length=1, description="logprob: the token text meaning yes (case and surrounding "
                     "spaces ignored).")
    no: str = Field("no", min_length=1, description="logprob: the token text meaning no.")
    top_logprobs: int = Field(20, gt=0, description="logprob: alternatives asked for; a yes or no outside them "
                              "counts as probability 0 (vLLM serves up to 20 by default).")
    max_tokens: int = Field(64, gt=0, description="generate: the verdict's token budget.")
    temperature: float = Field(0.0, ge=0, description="generate: sampling temperature (0: greedy, reproducible).")
    pattern: str = Field(r"(-?\d+(?:\.\d+)?)", description="generate: regex; its last match's first group (or "
                         "the whole match) is the number.")
    score_range: tuple[float, float] = Field((0.0, 10.0), description="generate: the number's [low, high], "
                                             "mapped to [0, 1] (outside it: clipped).")
    answer_key: str = Field("answer", description="Sample metadata key of the reference answer ({answer}).")
    timeout_s: float = Field(5.0, gt=0, description="Per HTTP request; below the per-sample timeout (an experiment's "
                             "reward.timeout_s, the reward service's default_timeout_s; both check), which bounds "
                             "the whole grading, retries included: a longer request would leave a retry no time.")
    retries: int = Field(2, ge=0, description="Retries of a request that failed to connect, timed out, or got "
                         "429 / 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="Wait before the first retry; doubled before each next.")
    max_concurrency: int = Field(8, gt=0, description="Requests in flight to the judge at once.")
    api_key_env: str | None = Field(None, description="Environment variable holding the bearer API key, if the "
                                    "endpoint wants one (the key itself never sits in a config).")

    @field_validator("template")
    @classmethod
    def _has_response(cls, value: str) -> str:
        if "{response}" not in value:
            raise ValueError("must contain {response} (and usually {prompt}, {answer})")
        return value

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _range_and_labels(self) -> "JudgeConfig":
        low, high = self.score_range
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"score_range: need finite low < high, got {list(self.score_range)}")
        if self.yes.strip().lower() == self.no.strip().lower():
            raise ValueError(f"yes and no must differ, both are {self.yes!r}")
        return self


class JudgeError(RuntimeError):
    """The judge could not be reached or refused the request (after retries)."""


def render(template: str, sample: Sample, answer_key: str = "answer") -> str:
    """The judge's prompt for `sample` (one pass: text filled in is never read as a placeholder)."""
    answer = sample.metadata.get(answer_key, "")
    if isinstance(answer, (list, tuple)):
        answer = " | ".join(str(a) for a in answer)
    values = {"prompt": sample.prompt_text, "response": sample.response_text, "answer": str(answer)}
    return _PLACEHOLDER.sub(lambda match: values[match[1]], template)


def yes_probability(top: dict[str, float], yes: str, no: str) -> tuple[float, float]:
    """(P(yes), P(no)) summed over the alternatives {text: logprob} whose stripped, lower-cased text matches."""
    p_yes = sum(math.exp(lp) for text, lp in top.items() if text.strip().lower() == yes.strip().lower())
    p_no = sum(math.exp(lp) for text, lp in top.items() if text.strip().lower() == no.strip().lower())
    return p_yes, p_no


def read_verdict(text: str, pattern: str, score_range: tuple[float, float]) -> float | None:
    """The last match of `pattern` in `text` as a number scaled from score_range to [0, 1]; None when none."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = float(last[1] if last.re.groups else last[0])
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    low, high = score_range
    return min(1.0, max(0.0, (value - low) / (high - low)))


class Judge:
    """Grades samples through one served model; one HTTP client and concurrency limit per judge."""

    def __init__(self, name: str, config: JudgeConfig):
        self.name, self.config = name, config
        self.endpoint = config.url.rstrip("/") + "/completions"
        self._limit = asyncio.Semaphore(config.max_concurrency)
        self._client: httpx.AsyncClient | None = None

    async def score(self, sample: Sample, timeout_s: float) -> RewardOutput:
        """Grade `sample`; TimeoutError when its grading (retries included) takes longer than `timeout_s`.

        The clock starts once one of the judge's `max_concurrency` slots is free, as a worker's does once a
        worker is free: a batch larger than the limit waits its turn without eating its samples' timeouts.
        """
        prompt = render(self.config.template, sample, self.config.answer_key)
        grade = self._score_logprob if self.config.mode == "logprob" else self._score_generate
        async with self._limit:
            output = await asyncio.wait_for(grade(prompt), timeout_s)
        if output.details.get("judge_unparsed"):
            JUDGE_UNPARSED.labels(self.name).inc()
        return output

    async def _score_logprob(self, prompt: str) -> RewardOutput:
        choice = await self._complete({"prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                       "logprobs": self.config.top_logprobs})
        tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
        if not tops:
            raise JudgeError(f"judge {self.name!r}: the reply has no top_logprobs (does {self.endpoint} serve "
                             "`logprobs` > 0 on completions?)")
        p_yes, p_no = yes_probability(tops[0], self.config.yes, self.config.no)
        note = f"judge next-token alternatives: {sorted(tops[0], key=tops[0].get, reverse=True)[:5]}"[:_MAX_NOTE]
        if p_yes + p_no == 0:
            return RewardOutput(0.0, {"judge_unparsed": 1.0}, f"neither {self.config.yes!r} nor {self.config.no!r} "
                                f"among the judge's top {self.config.top_logprobs}; {note}"[:_MAX_NOTE])
        return RewardOutput(p_yes / (p_yes + p_no), {"judge_p_yes": p_yes, "judge_p_no": p_no}, note)

    async def _score_generate(self, prompt: str) -> RewardOutput:
        choice = await self._complete({"prompt": prompt, "max_tokens": self.config.max_tokens,
                                       "temperature": self.config.temperature})
        verdict = choice.get("text") or ""
        score = read_verdict(verdict, self.config.pattern, self.config.score_range)
        if score is None:
            return RewardOutput(0.0, {"judge_unparsed": 1.0}, f"unparsed verdict: {verdict!r}"[:_MAX_NOTE])
        return RewardOutput(score, {"judge_score": score}, f"verdict: {verdict!r}"[:_MAX_NOTE])

    async def _complete(self, body: dict) -> dict:
        """POST a completion and return its first choice; retries what a retry may fix, with backoff."""
        body = {"model": self.config.model, **body}
        attempts = self.config.retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            try:
                reply = await self._http().post(self.endpoint, json=body)
            except httpx.TransportError as exc:  # connect refused, timeout, reset
                problem = f"{type(exc).__name__}: {exc or 'no answer'}"
                continue
            if reply.status_code == 429 or reply.status_code >= 500:
                problem = f"HTTP {reply.status_code}: {_message(reply)}"
                continue
            if reply.status_code != 200:
                raise JudgeError(f"judge {self.name!r} refused the request (HTTP {reply.status_code} from "
                                 f"{self.endpoint}): {_message(reply)}")
            try:
                return reply.json()["choices"][0]
            except (ValueError, KeyError, IndexError, TypeError):
                raise JudgeError(f"judge {self.name!r}: {self.endpoint} answered something that is not a "
                                 f"completion: {reply.text[:200]!r}") from None
        raise JudgeError(f"judge {self.name!r} at {self.endpoint} did not answer after {attempts} attempt(s): "
                         f"{problem}")

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the loop that uses it
            headers = {}
            if self.config.api_key_env:
                headers["Authorization"] = f"Bearer {os.environ.get(self.config.api_key_env, '')}"
            self._client = httpx.AsyncClient(timeout=self.config.timeout_s, headers=headers,
                                             limits=httpx.Limits(max_connections=self.config.max_concurrency))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _message(reply: httpx.Response) -> str:
    """The error message of an OpenAI-shaped error body, else the start of the body."""
    try:
        return str(reply.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return reply.text[:300]
