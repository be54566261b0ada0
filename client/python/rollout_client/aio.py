"""RolloutClient for asyncio (grpc.aio): the blocking client's methods, as coroutines.

    from rollout_client.aio import RolloutClient

    async with RolloutClient("127.0.0.1:50051") as client:
        await client.wait_ready(30)
        groups = await client.generate([[1, 2, 3]], num_samples=8, seed=7, max_new_tokens=64)
        async for item in client.generate([[1, 2, 3]], max_new_tokens=64, stream=True):
            ...

Arguments, results and errors are those of rollout_client.RolloutClient (RolloutError with the
gRPC status code name; a method's timeout= left out is the client's default deadline, None is no
deadline). One client serves many concurrent calls from one event loop; create it inside the
loop that uses it (grpc.aio binds a channel to the loop).
"""

from __future__ import annotations

import asyncio
import time
from typing import (Any, AsyncIterator, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc
import grpc.aio

from . import _wire, ipc
from ._wire import DEFAULT_TIMEOUT, IntOrList, Timeout, pb2, pb2_grpc
from .datatypes import (AbortResult, Completion, FlushCacheResult, ReleaseMemoryResult,
                        ResumeMemoryResult, RolloutError, ServerInfo, TokenChunk,
                        UpdateWeightsResult, WeightSyncGroup, message_to_dataclass)
from .weights import DTypeSpec

__all__ = ["RolloutClient"]


class RolloutClient:
    """asyncio client of a rollout server (see the module docstring)."""

    def __init__(self, target: str = "127.0.0.1:50051", token: Optional[str] = None,
                 timeout: Optional[float] = None,
                 tls_root_cert: _wire.PemSource = None,
                 options: Sequence[Tuple[str, Any]] = (), *,
                 tls_client_cert: _wire.PemSource = None,
                 tls_client_key: _wire.PemSource = None):
        self.target = target
        self.timeout = _wire.check_timeout(timeout)
        self._metadata = _wire.bearer_metadata(token)
        self._credentials = _wire.channel_credentials(tls_root_cert, tls_client_cert,
                                                      tls_client_key)
        self._options = list(options)
        self._channel = _wire.open_channel(grpc.aio, target, self._credentials, options)
        self._stub = pb2_grpc.RolloutServiceStub(self._channel)

    # -- lifecycle ----------------------------------------------------------------------------

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def stub(self):
        """The raw generated stub (on the grpc.aio channel)."""
        return self._stub

    async def wait_ready(self, timeout: float = 30.0) -> ServerInfo:
        """Waits until the server answers GetServerInfo; returns the info. RolloutError
        DEADLINE_EXCEEDED (or the server's error, e.g. UNAUTHENTICATED) otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RolloutError("DEADLINE_EXCEEDED",
                                   f"server at {self.target} not ready after {timeout}s ({last})",
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
            try:
                await asyncio.wait_for(self._channel.channel_ready(), min(remaining, 1.0))
                return await self.server_info(timeout=max(remaining, 0.1))
            except asyncio.TimeoutError:
                last = "not connected"
            except RolloutError as e:
                if e.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise
                last = str(e)
                await asyncio.sleep(0.05)

    # -- helpers ------------------------------------------------------------------------------

    def _timeout(self, timeout: Timeout) -> Optional[float]:
        """The gRPC deadline of a call given `timeout` (DEFAULT_TIMEOUT: the client's)."""
        return _wire.deadline(self.timeout, timeout)

    async def _unary(self, method, request, timeout: Timeout):
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise RolloutError.from_rpc_error(e) from None

    # -- Generate -----------------------------------------------------------------------------

    async def _stream(self, request, request_ids,
                      deadline: Optional[float]) -> AsyncIterator[Union[TokenChunk, Completion]]:
        call = self._stub.Generate(request, timeout=deadline, metadata=self._metadata)
        done = False
        try:
            async for response in call:
                item = _wire.stream_item(response, request_ids)
                if item is not None:
                    yield item
            done = True
        except grpc.RpcError as e:
            done = True
            raise RolloutError.from_rpc_error(e) from None
        finally:
            if not done:  # left early (break, aclose, task cancelled): end the samples
                call.cancel()

    async def _collect(self, request, request_ids,
                       deadline: Optional[float]) -> List[List[Completion]]:
        table = _wire.CompletionTable(request)
        async for item in self._stream(request, request_ids, deadline):
            table.add(item)
        return table.result(
            lambda message: RolloutError("INTERNAL", message, grpc.StatusCode.INTERNAL))

    def generate(self, prompts: Sequence[Sequence[int]], *, num_samples: IntOrList = 1,
                 seed: IntOrList = 0, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, max_new_tokens: int,
                 stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 top_logprobs: int = 0, request_ids: Optional[Sequence[str]] = None,
                 stream: bool = False, chunk_tokens: int = 0, chunk_interval_ms: int = 0,
                 completions_only: Optional[bool] = None,
                 timeout: Timeout = DEFAULT_TIMEOUT, return_routing: bool = False):
        """As rollout_client.RolloutClient.generate. Without stream: a coroutine returning
        completions[prompt][sample]. With stream=True: an async iterator of TokenChunk and
        Completion (`async for`); leaving it early (break, aclose(), a cancelled task) cancels
        the call, which aborts the samples. Arguments are checked at the call, before any
        await."""
        if completions_only is None:
            completions_only = not stream and not chunk_tokens and not chunk_interval_ms
        request, ids = _wire.generate_request(
            prompts, num_samples, seed, temperature, top_k, top_p, min_p, max_new_tokens,
            stop_token_ids, ignore_eos, top_logprobs, request_ids, completions_only,
            chunk_tokens, chunk_interval_ms, return_routing)
        deadline = self._timeout(timeout)
        if stream:
            return self._stream(request, ids, deadline)
        return self._collect(request, ids, deadline)

    # -- Score --------------------------------------------------------------------------------

    async def score(self, sequences: Sequence[Sequence[int]], starts: IntOrList,
                    temperature: Union[None, float, Sequence[Optional[float]]] = None,
                    top_logprobs: int = 0, *, details: bool = False,
                    timeout: Timeout = DEFAULT_TIMEOUT,
                    routings: Optional[Sequence[Optional[Sequence[int]]]] = None,
                    return_routing: bool = False):
        """As rollout_client.RolloutClient.score."""
        request = _wire.score_request(sequences, starts, temperature, top_logprobs, routings,
                                      return_routing)
        return _wire.score_results(await self._unary(self._stub.Score, request, timeout),
                                   details)

    # -- weights ------------------------------------------------------------------------------

    async def update_weights(self,
                             named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                             version: str, policy: Optional[str] = "drain", *,
                             dtype: DTypeSpec = "BF16", chunk_bytes: int = 4 << 20,
                             bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                             skip_tied: bool = True, streams: int = 1,
                             timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """As rollout_client.RolloutClient.update_weights (streams included). Tensors are
        converted on background threads; the event loop only hands the encoded chunks to
        gRPC."""
        deadline = self._timeout(timeout)
        if skip_tied and (await self.server_info(timeout=deadline)).model.tie_word_embeddings:
            named_tensors = _wire.without_tied_lm_head(named_tensors)
        parts = _wire.weights_part_streams(named_tensors, version, policy, dtype, chunk_bytes,
                                           bucket_bytes, streams)
        loop = asyncio.get_running_loop()
        # Part 0 on this client's channel, every other on a channel (a connection) of its own.
        channels = [self._channel] + [
            _wire.open_channel(grpc.aio, self.target, self._credentials,
                               self._options + [("grpc.use_local_subchannel_pool", 1)])
            for _ in parts[1:]]
        first: List[BaseException] = []  # the first failure: a conversion error or the server's

        async def recorded(stream):
            it = stream.messages(0)
            try:
                while True:
                    # Waiting for a bucket's conversion blocks: off the event loop.
                    m = await loop.run_in_executor(None, next, it, None)
                    if m is None:
                        return
                    yield m
            except (GeneratorExit, asyncio.CancelledError):
                raise  # the call ended (failed or cancelled elsewhere): a consequence, no cause
            except BaseException as e:  # surfaced below instead of gRPC's CANCELLED
                if not first:
                    first.append(e)
                raise
            finally:
                try:
                    it.close()
                except ValueError:  # cancelled while next() ran on the executor
                    pass

        async def send(i):
            try:
                return await _wire.update_weights_call(channels[i])(
                    recorded(parts[i]), timeout=deadline, metadata=self._metadata)
            except grpc.RpcError as e:
                if not first:
                    first.append(RolloutError.from_rpc_error(e))
                raise

        start = loop.time()
        tasks = [asyncio.ensure_future(send(i)) for i in range(len(parts))]
        try:
            # The server fails every part when one fails; the others need not send on.
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if first:
                raise first[0] from None
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            return _wire.update_result(results[0], loop.time() - start)
        finally:
            for part in parts:
                part.stop(0)
            for channel in channels[1:]:
                await channel.close()

    async def update_weights_from_ipc(self,
                                      named_tensors: Union[Iterable[Tuple[str, Any]],
                                                           Mapping[str, Any]],
                                      version: str, policy: Optional[str] = "drain", *,
                                      skip_tied: bool = True,
                                      timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """As rollout_client.RolloutClient.update_weights_from_ipc. The export (a device
        synchronize, then one _share_cuda_ per storage) runs on the event loop's thread."""
        if skip_tied and (await self.server_info(timeout=timeout)).model.tie_word_embeddings:
            named_tensors = _wire.without_tied_lm_head(named_tensors)
        start = time.monotonic()
        with ipc.export_tensors(named_tensors) as exported:
            request = _wire.ipc_request(exported.tensors, version, policy)
            response = await self._unary(self._stub.UpdateWeightsFromIpc, request, timeout)
        return _wire.update_result(response, time.monotonic() - start)

    async def update_weights_from_path(self, path: str, version: str,
                                       policy: Optional[str] = "drain", *,
                                       timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """As rollout_client.RolloutClient.update_weights_from_path."""
        request = _wire.update_from_path_request(path, version, policy)
        start = time.monotonic()
        response = await self._unary(self._stub.UpdateWeightsFromPath, request, timeout)
        return _wire.update_result(response, time.monotonic() - start)

    async def join_weight_sync_group(self, unique_id: bytes, rank: int, world_size: int, *,
                                     group_timeout: float = 0.0,
                                     timeout: Timeout = DEFAULT_TIMEOUT) -> WeightSyncGroup:
        """As rollout_client.RolloutClient.join_weight_sync_group."""
        request = _wire.join_request(unique_id, rank, world_size, group_timeout)
        return message_to_dataclass(
            WeightSyncGroup, await self._unary(self._stub.JoinWeightSyncGroup, request, timeout))

    async def leave_weight_sync_group(self, *, timeout: Timeout = DEFAULT_TIMEOUT
                                      ) -> Optional[WeightSyncGroup]:
        """As rollout_client.RolloutClient.leave_weight_sync_group."""
        r = await self._unary(self._stub.LeaveWeightSyncGroup,
                              pb2.LeaveWeightSyncGroupRequest(), timeout)
        return WeightSyncGroup(r.rank, r.world_size) if r.was_member else None

    async def update_weights_from_broadcast(self, tensors: Sequence[Any], version: str,
                                            policy: Optional[str] = "drain", *,
                                            bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                                            source_rank: int = 0,
                                            broadcast_timeout: float = 0.0,
                                            expected_weight_digest: Optional[str] = None,
                                            timeout: Timeout = DEFAULT_TIMEOUT
                                            ) -> UpdateWeightsResult:
        """As rollout_client.RolloutClient.update_weights_from_broadcast."""
        request = _wire.broadcast_request(tensors, version, policy, bucket_bytes, source_rank,
                                          broadcast_timeout, expected_weight_digest)
        start = asyncio.get_running_loop().time()
        response = await self._unary(self._stub.UpdateWeightsFromBroadcast, request, timeout)
        return _wire.update_result(response, asyncio.get_running_loop().time() - start)

    # -- control ------------------------------------------------------------------------------

    async def pause(self, abort_in_flight: bool = False, *,
                    timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        r = await self._unary(self._stub.Pause,
                              pb2.PauseRequest(abort_in_flight=abort_in_flight), timeout)
        return r.was_paused

    async def resume(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        return (await self._unary(self._stub.Resume, pb2.ResumeRequest(), timeout)).was_paused

    async def release_memory(self, weights: bool = False, abort_in_flight: bool = False, *,
                             timeout: Timeout = DEFAULT_TIMEOUT) -> ReleaseMemoryResult:
        """As rollout_client.RolloutClient.release_memory."""
        request = pb2.ReleaseMemoryRequest(weights=weights, abort_in_flight=abort_in_flight)
        r = await self._unary(self._stub.ReleaseMemory, request, timeout)
        return message_to_dataclass(ReleaseMemoryResult, r)

    async def resume_memory(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ResumeMemoryResult:
        """As rollout_client.RolloutClient.resume_memory."""
        r = await self._unary(self._stub.ResumeMemory, pb2.ResumeMemoryRequest(), timeout)
        return message_to_dataclass(ResumeMemoryResult, r)

    async def abort(self, request_ids: Union[None, str, Sequence[str]] = None,
                    all: bool = False, *, timeout: Timeout = DEFAULT_TIMEOUT) -> AbortResult:
        r = await self._unary(self._stub.Abort, _wire.abort_request(request_ids, all), timeout)
        return _wire.abort_result(r)

    async def flush_cache(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> FlushCacheResult:
        r = await self._unary(self._stub.FlushCache, pb2.FlushCacheRequest(), timeout)
        return _wire.flush_result(r)

    async def server_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ServerInfo:
        r = await self._unary(self._stub.GetServerInfo, pb2.GetServerInfoRequest(), timeout)
        return message_to_dataclass(ServerInfo, r)
