"""The driver reaches services that have tokens on: DriverConfig.clients carries the token (or TLS files) it
presents to each (what `relayrl deploy k8s` fills from the experiment's services.*.client)."""

import grpc
import pytest

from protos import buffer_pb2
from rollout.driver.driver import Driver, DriverConfig


@pytest.mark.parametrize("token", ["driver-token", None])
async def test_the_driver_presents_its_token_to_a_buffer_with_auth(tmp_path, service_factory, tiny_model_dir, token):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"),
                                        "server.auth": {"tokens": {"driver-token": "driver"}}})
    clients = {"buffer": {"token": token}} if token else {}
    driver = Driver(DriverConfig.model_validate({
        "rollout": buffer.address, "reward": buffer.address, "buffer": buffer.address, "clients": clients,
        "prompts": str(tmp_path / "prompts.jsonl"), "tokenizer": str(tiny_model_dir)}))
    try:
        if token:
            stats = await driver.buffer.Stats(buffer_pb2.StatsRequest(), timeout=10)
            assert stats.pending == 0
        else:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await driver.buffer.Stats(buffer_pb2.StatsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await driver.close()
