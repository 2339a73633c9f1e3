"""The prefill and decode workers' servicers in one process (rollout/pd/prefill.py, rollout/pd/decode.py), a stand-in
for the gRPC stub between them: KV encoding, decoding and CRC-32 run off the event loop, and a prefill computed with
other weights than the decode worker serves is pulled again with a pause that doubles, a bounded number of times
(KV of newer weights waits for them, not pulled again)."""

import asyncio
import dataclasses
import itertools
import threading
import time
import zlib
from types import SimpleNamespace

import grpc
import pytest
import torch

from protos import kv_pb2, rollout_pb2
from protos.codec import encode_array
from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.kv_handoff import prefill_for_transfer
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv import codecs
from rollout.pd import transfer
from rollout.pd.decode import DecodeServicer, params_proto
from rollout.pd.prefill import PrefillServicer
from rollout.pd.transfer import pack

torch.set_num_threads(1)
PROMPT = [3 + (7 * j) % 90 for j in range(37)]
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=5, ignore_eos=True)


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


class Stub:
    """A prefill worker's stub whose every Prefill streams `chunks`; `calls` holds when each came."""

    def __init__(self, chunks: list[kv_pb2.KVTransferChunk]):
        self.chunks, self.calls = chunks, []

    def Prefill(self, ask, timeout=None):
        self.calls.append(time.monotonic())

        async def stream():
            for chunk in self.chunks:
                yield chunk

        return stream()


@pytest.fixture(scope="module")
def engines(sharp_model_dir):
    """(prefill engine, decode engine): two LLMEngines of the sharp tiny model."""
    config = EngineConfig(model=str(sharp_model_dir), max_model_len=128, max_n=2)
    return LLMEngine(config), LLMEngine(config)


@pytest.fixture
def decode(engines):
    async_engine = AsyncEngine(engines[1])
    yield async_engine
    async_engine.shutdown()


def transfer_of(engine: LLMEngine, version: int, codec: str = "none") -> list[kv_pb2.KVTransferChunk]:
    engine.weight_version = version
    prefilled = prefill_for_transfer(engine, "r", PROMPT, PARAMS)
    return list(pack(rollout_pb2.GenerateRequest(request_id="r", params=params_proto(PARAMS)), prefilled, codec))


def decode_servicer(async_engine: AsyncEngine, stub: Stub, import_wait_s: float) -> DecodeServicer:
    servicer = DecodeServicer(async_engine, "m", async_engine.tokenizer, [], import_wait_s=import_wait_s)
    servicer.prefill_stubs, servicer._next_prefill = [stub], itertools.cycle([0])
    return servicer


@pytest.mark.parametrize("found_at", ["header", "import"])
def test_kv_of_older_weights_is_pulled_again_backing_off_then_refused_with_what_it_cost(engines, decode, found_at,
                                                                                      monkeypatch):
    """The prefill worker still serves version 0, this worker 1: four pulls again at pauses of 20, 40, 80, 160 ms, then
    FAILED_PRECONDITION that says what it cost. Before, a mismatch found in the header was refused at once, and one
    found at the import (this worker's version changed after the header's check) was pulled again every 20 ms for up
    to import_wait_s, each pull shipping the whole prefill."""
    stub = Stub(transfer_of(engines[0], version=0))
    engines[1].weight_version = 1
    if found_at == "import":  # the header is checked against version 0, the import against 1
        from rollout.engine import kv_handoff

        layout = kv_handoff.served_layout
        monkeypatch.setattr(kv_handoff, "served_layout", lambda engine: dataclasses.replace(layout(engine),
                                                                                          weight_version=0))
    servicer = decode_servicer(decode, stub, import_wait_s=3.0)
    servicer.max_repulls = 4
    with pytest.raises(Aborted) as refused:
        asyncio.run(servicer._generate_all("r", PROMPT, PARAMS, Context()))
    code, details = refused.value.args
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert len(stub.calls) == 5, f"{len(stub.calls)} pulls"
    payload = stub.chunks[0].header.payload_bytes
    assert f"5 pulls of the prefill ({5 * payload} bytes)" in details and "this worker serves 1" in details
    gaps = [b - a for a, b in zip(stub.calls, stub.calls[1:])]
    assert gaps[-1] >= 0.16 and sum(gaps) >= 0.3


def test_kv_of_newer_weights_waits_for_them_and_is_not_pulled_again(engines, decode):
    """The prefill worker already serves version 2, this worker 1 until its update lands 0.3 s later: the transfer it
    holds is imported then, pulled once (was: pulled again every 20 ms meanwhile)."""
    stub = Stub(transfer_of(engines[0], version=2))
    engines[1].weight_version = 1
    servicer = decode_servicer(decode, stub, import_wait_s=10.0)

    async def run():
        async def update_later():
            await asyncio.sleep(0.3)
            await decode.update_weights({}, 2)

        update = asyncio.create_task(update_later())
        completions = await servicer._generate_all("r", PROMPT, PARAMS, Context())
        await update
        return completions

    completions = asyncio.run(run())
    assert len(stub.calls) == 1
    assert [len(c.token_ids) for c in completions] == [PARAMS.max_tokens] * 2
    assert all(v == 2 for c in completions for v in c.weight_versions)


def test_encoding_decoding_and_checksums_run_off_the_event_loop(engines, decode, monkeypatch):
    """Encoding a prompt's KV, its copy to bytes, its CRC-32 and decoding take milliseconds per megabyte: on the event
    loop they stalled every other call of the worker (issue 28). Each runs in another thread."""
    seen: dict[str, set[int]] = {}

    def record(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    for cls, method in ((codecs.Quantized, "encode"), (codecs.Quantized, "decode"), (codecs.KVCodec, "from_bytes"),
                        (codecs.EncodedKV, "to_bytes")):
        monkeypatch.setattr(cls, method, record(f"{cls.__name__}.{method}", getattr(cls, method)))
    for name in ("to_buffer", "from_buffer"):  # what the fixed code calls (absent before)
        for cls in (codecs.EncodedKV, codecs.KVCodec):
            if hasattr(cls, name):
                monkeypatch.setattr(cls, name, record(f"{cls.__name__}.{name}", getattr(cls, name)))
    monkeypatch.setattr(transfer, "zlib", SimpleNamespace(crc32=record("crc32", zlib.crc32)))
    engines[0].weight_version = engines[1].weight_version = 0

    async def prefilled(request_id, prompt, params, images=()):
        return prefill_for_transfer(engines[0], request_id, prompt, params, images)

    prefill = PrefillServicer(SimpleNamespace(prefill_for_transfer=prefilled), None, codec="int8")
    ask = kv_pb2.PrefillRequest(request=rollout_pb2.GenerateRequest(
        request_id="r", prompt_ids=encode_array(PROMPT, "int32"), params=params_proto(PARAMS)))

    async def run():
        chunks = [chunk async for chunk in prefill.Prefill(ask, Context())]
        servicer = decode_servicer(decode, Stub(chunks), import_wait_s=10.0)
        return await servicer._generate_all("r", PROMPT, PARAMS, Context())

    loop_thread = threading.get_ident()  # asyncio.run's loop runs in this thread
    completions = asyncio.run(run())
    assert [len(c.token_ids) for c in completions] == [PARAMS.max_tokens] * 2
    assert {"Quantized.encode", "Quantized.decode", "crc32"} <= set(seen)
    on_loop = sorted(name for name, threads in seen.items() if loop_thread in threads)
    assert not on_loop, f"on the event loop: {on_loop}"
