"""Reward functions by name: built-ins, runtime registrations and "pkg.module:function" paths.

A per-sample function is `fn(sample: Sample, **args) -> RewardOutput | float`; a batched one
(a reward model) is `fn(samples: list[Sample], **args) -> list[RewardOutput | float]`. The
registry holds *where* a function lives (a dotted target), not the function itself, so a
worker process can import it by name and the server never imports what it does not call.
"""

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardOutput:
    """A score and its named components (e.g. {"format": 1.0, "correct": 0.0})."""

    score: float
    details: dict[str, float] = field(default_factory=dict)
    # A short human-readable note (why a code sample scored 0.4, what was extracted, ...).
    note: str = ""


@dataclass(frozen=True)
class RewardSpec:
    """Where a reward function lives and how to call it."""

    name: str
    # "package.module:function" (the function may be a nested attribute: "mod:Class.method").
    target: str
    # A batched function gets the list of samples at once (reward models).
    batched: bool = False
    # Arguments fixed by the server (a model path); a request cannot override them.
    bound_args: Mapping[str, Any] = field(default_factory=dict)
    # "module:function" called with the same arguments before scoring, outside the per-sample
    # timeout, to load what the function needs (a reward model's weights).
    prepare: str | None = None
    # Safe to run in the server process: pure, no imports of user code, no pattern from the request,
    # and run time bounded by the length of the response (the scorer caps that length). Saves a
    # worker round trip per sample; everything else runs in workers that a timeout can kill.
    inline: bool = False


class UnknownFunction(LookupError):
    """No function of that name, or a dotted path while custom functions are not allowed."""


class BadFunction(ValueError):
    """The function cannot be imported, or the arguments do not fit its signature."""


BUILTINS: dict[str, RewardSpec] = {
    spec.name: spec
    for spec in (
        RewardSpec("exact_match", "reward.match:exact_match", inline=True),
        RewardSpec("numeric_match", "reward.match:numeric_match", inline=True),
        RewardSpec("regex_match", "reward.match:regex_match"),
        RewardSpec("math_verify", "reward.math:math_verify"),
        RewardSpec("code_exec", "reward.code:code_exec"),
    )
}

DOTTED_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$"
_DOTTED = re.compile(DOTTED_PATTERN)


class Registry:
    """Name -> RewardSpec. Starts with the built-ins; `register` adds more."""

    def __init__(self, specs: Mapping[str, RewardSpec] = BUILTINS):
        self.specs: dict[str, RewardSpec] = dict(specs)

    def names(self) -> list[str]:
        return sorted(self.specs)

    def add(self, spec: RewardSpec) -> RewardSpec:
        if spec.name in self.specs:
            raise ValueError(f"reward function {spec.name!r} is already registered")
        if not _DOTTED.match(spec.target):
            raise ValueError(f"{spec.name}: target {spec.target!r} is not 'package.module:function'")
        self.specs[spec.name] = spec
        return spec

    def register(self, name: str | None = None, *, batched: bool = False) -> Callable[[Callable], Callable]:
        """Decorator: register a module-level function under `name` (default: its own name).

        Worker processes import it by its module path, so the function must be importable.
        """

        def decorate(fn: Callable) -> Callable:
            if "<locals>" in fn.__qualname__:
                raise ValueError(f"{fn.__qualname__}: only module-level functions can be registered "
                                 "(worker processes import them by path)")
            self.add(RewardSpec(name or fn.__name__, f"{fn.__module__}:{fn.__qualname__}", batched))
            return fn

        return decorate

    def get(self, name: str, *, allow_custom: bool = False) -> RewardSpec:
        """The spec for `name`; a "pkg.module:function" path when `allow_custom` (not imported here)."""
        if name in self.specs:
            return self.specs[name]
        if ":" in name and allow_custom:
            if not _DOTTED.match(name):
                raise UnknownFunction(f"function {name!r}: not a 'package.module:function' path")
            return RewardSpec(name, name)
        if ":" in name:
            raise UnknownFunction(f"function {name!r}: custom functions by path are not allowed on this server")
        known = ", ".join(self.names())
        raise UnknownFunction(f"unknown reward function {name!r} (known: {known})")


def load(spec: RewardSpec) -> Callable:
    """Import the function a spec points at."""
    module_name, _, attr_path = spec.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise BadFunction(f"function {spec.name!r}: cannot import {spec.target} ({exc})") from exc
    if not callable(obj):
        raise BadFunction(f"function {spec.name!r}: {spec.target} is not callable")
    return obj


def call_args(spec: RewardSpec, request_args: Mapping[str, Any]) -> dict[str, Any]:
    """Request arguments merged under the server's bound ones; the bound ones cannot be overridden."""
    clash = sorted(set(request_args) & set(spec.bound_args))
    if clash:
        raise BadFunction(f"function {spec.name!r}: argument(s) {', '.join(clash)} are fixed by the server")
    return {**request_args, **spec.bound_args}


def check_args(spec: RewardSpec, fn: Callable, args: Mapping[str, Any]) -> None:
    """Raise BadFunction when `args` do not fit `fn(sample_or_samples, **args)`."""
    try:
        inspect.signature(fn).bind(None, **args)
    except TypeError as exc:
        raise BadFunction(f"function {spec.name!r}: bad function_args ({exc})") from None


_MAX_NOTE = 1000


def as_output(value: Any, name: str) -> RewardOutput:
    """Accept a RewardOutput or a plain number (bools count) from a function; anything else is its bug.

    The result is what the wire can carry: a finite float score, details of str -> float, a str note.
    """
    if isinstance(value, (int, float)):
        value = RewardOutput(float(value))
    if not isinstance(value, RewardOutput):
        raise TypeError(f"{name} returned {type(value).__name__}, expected RewardOutput or float")
    if not isinstance(value.score, (int, float)) or not math.isfinite(value.score):
        raise ValueError(f"{name} returned a score that is not a finite number ({value.score!r})")
    bad = {k: v for k, v in value.details.items() if not isinstance(k, str) or not isinstance(v, (int, float))}
    if bad:
        raise TypeError(f"{name} returned details that are not str -> number: {bad!r}"[:300])
    if not isinstance(value.note, str):
        raise TypeError(f"{name} returned a note of type {type(value.note).__name__}, expected str")
    return RewardOutput(float(value.score), {k: float(v) for k, v in value.details.items()}, value.note[:_MAX_NOTE])


REGISTRY = Registry()
register = REGISTRY.register
get = REGISTRY.get
