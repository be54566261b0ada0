"""RolloutClient: a typed, blocking Python client of rollout.v1.RolloutService."""

from __future__ import annotations

import threading
import time
from typing import (Any, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union)

import grpc

from . import _wire, ipc
from ._wire import DEFAULT_TIMEOUT, IntOrList, Timeout, pb2, pb2_grpc
from .datatypes import (AbortResult, Completion, FlushCacheResult, ReleaseMemoryResult,
                        ResumeMemoryResult, RolloutError, ServerInfo, TokenChunk,
                        UpdateWeightsResult, WeightSyncGroup, message_to_dataclass)
from .weights import DTypeSpec

# Kept for callers that build raw messages: the generated modules.
__all__ = ["RolloutClient", "pb2", "pb2_grpc"]


class RolloutClient:
    """Blocking client of a rollout server. Thread-safe (one gRPC channel, shared).

        with RolloutClient("127.0.0.1:50051") as client:
            client.wait_ready(30)
            groups = client.generate([[1, 2, 3]], num_samples=8, seed=7, max_new_tokens=64)
            for c in groups[0]:
                print(c.token_ids, c.logprobs, c.finish_reason, c.weight_version)

    Failures raise RolloutError(code, message) with the gRPC status code name and the server's
    message; bad Python arguments raise TypeError/ValueError before anything is sent.
    `timeout` (seconds) is the default deadline of every call (None: none). Each method also
    takes `timeout=`: left out (rollout_client.DEFAULT_TIMEOUT), the call has the client's
    default; None, no deadline at all, whatever the default; a number, that many seconds. A
    deadline is a positive number up to 1e9 (TypeError/ValueError naming `timeout` otherwise).
    `token` is sent as `authorization: Bearer <token>` on every call (its line end left out:
    token=open(path).read() works). `tls_root_cert` (a PEM path or PEM bytes) makes the
    channel TLS; otherwise plaintext. `tls_client_cert` and `tls_client_key`
    (both, with tls_root_cert) present a client certificate, for a server that verifies
    clients (its --tls_client_ca: mutual TLS); the files are read here, once.
    rollout_client.aio.RolloutClient has the same methods for asyncio.
    """

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
        self._channel = _wire.open_channel(grpc, target, self._credentials, options)
        self._stub = pb2_grpc.RolloutServiceStub(self._channel)

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def stub(self):
        """The raw generated stub, for anything this wrapper does not cover."""
        return self._stub

    def wait_ready(self, timeout: float = 30.0) -> ServerInfo:
        """Blocks until the server answers GetServerInfo (it listens only once its model is
        loaded); returns the info. RolloutError DEADLINE_EXCEEDED (or the server's error, e.g.
        UNAUTHENTICATED) otherwise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RolloutError("DEADLINE_EXCEEDED",
                                   f"server at {self.target} not ready after {timeout}s ({last})",
                                   grpc.StatusCode.DEADLINE_EXCEEDED)
            try:
                grpc.channel_ready_future(self._channel).result(timeout=min(remaining, 1.0))
                return self.server_info(timeout=max(remaining, 0.1))
            except grpc.FutureTimeoutError:
                last = "not connected"
            except RolloutError as e:
                if e.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise
                last = str(e)
                time.sleep(0.05)

    # -- helpers ------------------------------------------------------------------------------

    def _timeout(self, timeout: Timeout) -> Optional[float]:
        """The gRPC deadline of a call given `timeout` (DEFAULT_TIMEOUT: the client's)."""
        return _wire.deadline(self.timeout, timeout)

    def _unary(self, method, request, timeout: Timeout):
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise RolloutError.from_rpc_error(e) from None

    # -- Generate -----------------------------------------------------------------------------

    def _stream(self, request, request_ids,
                deadline: Optional[float]) -> Iterator[Union[TokenChunk, Completion]]:
        call = self._stub.Generate(request, timeout=deadline, metadata=self._metadata)
        done = False
        try:
            for response in call:
                item = _wire.stream_item(response, request_ids)
                if item is not None:
                    yield item
            done = True
        except grpc.RpcError as e:
            done = True
            raise RolloutError.from_rpc_error(e) from None
        finally:
            if not done:  # the caller stopped iterating (or was interrupted): end the samples
                call.cancel()

    def generate(self, prompts: Sequence[Sequence[int]], *, num_samples: IntOrList = 1,
                 seed: IntOrList = 0, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 min_p: Optional[float] = None, max_new_tokens: int,
                 stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
                 top_logprobs: int = 0, request_ids: Optional[Sequence[str]] = None,
                 stream: bool = False, chunk_tokens: int = 0, chunk_interval_ms: int = 0,
                 completions_only: Optional[bool] = None,
                 timeout: Timeout = DEFAULT_TIMEOUT, return_routing: bool = False):
        """Samples completions of token-id prompts.

        prompts: a list of prompts, each a sequence of token ids (lists, numpy arrays, torch
        tensors; a 2-D array/tensor is a batch of equal-length prompts). Ids (stop_token_ids
        too) are integers in [0, 2**32): ints, numpy integers, arrays/tensors of an integer
        dtype; a float (even 2.0), a float array or tensor, or a bool raises TypeError naming
        prompts[i][j] and its value, never truncated. Integer arguments are checked against
        their field's range (seed [0, 2**64), counts [0, 2**32)): ValueError naming them.
        seed, num_samples, request_ids: one value for every prompt, or a list with one per
        prompt. Sample j of a prompt with seed s uses the seed sample_seed(s, j) (see
        docs/api.md), reported as Completion.sample_seed; sample 0 uses s itself.
        Sampling options apply to every prompt; None leaves the server default (temperature
        1.0, top_k off, top_p 1.0, min_p 0). temperature=0 is greedy. temperature, top_p and
        min_p are numbers (int, float, numpy scalars); anything else (a string, a bool, a list)
        raises TypeError naming the option; their range is the server's to check.

        Returns completions[prompt_index][sample_index] (a list of lists of Completion); the
        server then sends completions only (no per-token messages). With stream=True returns an
        iterator over TokenChunk and Completion objects as the server sends them (chunks of one
        sample concatenate to its completion; stopping the iteration early cancels the call,
        which aborts the samples): by default a chunk per engine step; chunk_tokens=N and/or
        chunk_interval_ms=M coalesce each sample's chunks (one every N tokens or M ms,
        whichever first), completions_only=True sends none. The tokens and logprob bits are
        the same in every case.
        return_routing=True (MoE models): each Completion.routing holds the experts chosen for
        every generated token at every MoE layer (docs/api.md, routing replay).
        timeout: seconds for the whole call (a stream's too); left out, the client's default;
        None, no deadline.
        """
        if completions_only is None:
            completions_only = not stream and not chunk_tokens and not chunk_interval_ms
        request, ids = _wire.generate_request(
            prompts, num_samples, seed, temperature, top_k, top_p, min_p, max_new_tokens,
            stop_token_ids, ignore_eos, top_logprobs, request_ids, completions_only,
            chunk_tokens, chunk_interval_ms, return_routing)
        deadline = self._timeout(timeout)  # checked at the call, not at a stream's first item
        if stream:
            return self._stream(request, ids, deadline)
        table = _wire.CompletionTable(request)
        for item in self._stream(request, ids, deadline):
            table.add(item)
        return table.result(
            lambda message: RolloutError("INTERNAL", message, grpc.StatusCode.INTERNAL))

    # -- Score --------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], starts: IntOrList,
              temperature: Union[None, float, Sequence[Optional[float]]] = None,
              top_logprobs: int = 0, *, details: bool = False,
              timeout: Timeout = DEFAULT_TIMEOUT,
              routings: Optional[Sequence[Optional[Sequence[int]]]] = None,
              return_routing: bool = False):
        """Teacher-forced logprobs of token_ids[start:] of each sequence (prompt + completion
        with start = len(prompt) gives exactly the logprobs Generate returned, bitwise, at the
        same temperature and weights).

        Token ids, starts and top_logprobs are checked as generate checks its arguments.
        Returns a list (per sequence) of logprob lists; with details=True a list of
        ScoreResult (logprobs, top_logprobs, weight_version, cached_tokens, routing).
        routings (MoE models): per sequence None or the routing its scored tokens' rows use
        instead of choosing -- a Completion.routing for start = len(prompt) -- so the logprobs
        are those of that routing; return_routing=True fills ScoreResult.routing (details).
        """
        request = _wire.score_request(sequences, starts, temperature, top_logprobs, routings,
                                      return_routing)
        return _wire.score_results(self._unary(self._stub.Score, request, timeout), details)

    # -- weights ------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                       version: str, policy: Optional[str] = "drain", *,
                       dtype: DTypeSpec = "BF16", chunk_bytes: int = 4 << 20,
                       bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                       skip_tied: bool = True, streams: int = 1,
                       timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """Streams new weights to the server: a WeightsHeader declaring every tensor, then each
        tensor's bytes in TensorData chunks of at most chunk_bytes. Nothing changes on the
        server until every byte arrived and was validated; then it swaps atomically.

        named_tensors: (name, tensor) pairs or a mapping, e.g. model.state_dict().items() with
        Hugging Face names; tensors as torch tensors (on any device: GPU tensors are converted
        there and reach the host through one pinned buffer, a bucket at a time), numpy arrays
        or RawTensor (see rollout_client.weights). dtype: the served dtype the values are
        converted to ("BF16", "F16", "F32"; a mapping name -> dtype or a callable for mixed
        models; None sends each tensor in its own dtype). A wrong dtype or shape is answered
        INVALID_ARGUMENT naming what the server expects. policy: what happens to samples in
        flight: "drain" (finish on the old weights first), "abort" or "continue" (go on with
        the new weights; see Completion.version_spans). bucket_bytes: tensors are converted in
        buckets of about this many bytes on a background thread while the previous bucket is
        sent (at most two buckets ahead). skip_tied: when the served model ties lm_head to the
        embedding, a state_dict's lm_head.weight (the same tensor) is left out instead of
        refused (one GetServerInfo call first). The result's seconds and bytes_per_second are
        the call's wall time and rate as this client saw them. streams > 1 spreads the update
        over that many concurrent calls, each on a channel (a connection) of its own, the
        tensors split by bytes; the server swaps once, when every part arrived (docs/api.md,
        "One update over several streams"), and a failure of any part fails them all (the
        first failure is raised). A server predating multi-part updates needs streams=1.
        chunk_bytes, bucket_bytes and streams are integers (TypeError naming them otherwise).
        Weights are floating point: an integer or bool array is refused (TypeError naming the
        tensor), not converted. timeout: as generate's, for each call this makes.
        """
        deadline = self._timeout(timeout)
        if skip_tied and self.server_info(timeout=deadline).model.tie_word_embeddings:
            named_tensors = _wire.without_tied_lm_head(named_tensors)
        streams_ = _wire.weights_part_streams(named_tensors, version, policy, dtype, chunk_bytes,
                                              bucket_bytes, streams)
        if len(streams_) > 1:
            return self._update_weights_parts(streams_, deadline)
        stream = streams_[0]
        failure: List[BaseException] = []

        def recorded():
            try:
                yield from stream.messages(0)
            except GeneratorExit:  # gRPC closing the stream after the call ended: no cause
                raise
            except BaseException as e:  # surfaced below instead of gRPC's CANCELLED
                failure.append(e)
                raise

        start = time.monotonic()
        try:
            response = _wire.update_weights_call(self._channel)(
                recorded(), timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            if failure:
                raise failure[0] from None
            raise RolloutError.from_rpc_error(e) from None
        finally:
            stream.stop(0)
        return _wire.update_result(response, time.monotonic() - start)

    def _update_weights_parts(self, parts, deadline: Optional[float]) -> UpdateWeightsResult:
        """The parts of one update at once, part 0 on this client's channel and each other on a
        channel of its own (a local subchannel pool: its own connection)."""
        channels = [self._channel] + [
            _wire.open_channel(grpc, self.target, self._credentials,
                               self._options + [("grpc.use_local_subchannel_pool", 1)])
            for _ in parts[1:]]
        lock = threading.Lock()
        first: List[BaseException] = []  # the first failure: a conversion error, or the server's
        futures: List[Any] = []

        def recorded(i):
            try:
                yield from parts[i].messages(0)
            except GeneratorExit:
                # gRPC closing a part's stream because its call ended (the server failed every
                # part, or on_done cancelled it): a consequence, never the update's failure.
                raise
            except BaseException as e:  # surfaced below instead of gRPC's CANCELLED
                with lock:
                    if not first:
                        first.append(e)
                raise

        def on_done(future):
            error = future.exception() if not future.cancelled() else None
            if error is None:
                return
            with lock:
                if not first:
                    first.append(RolloutError.from_rpc_error(error))
                others = list(futures)
            for f in others:  # the server fails every part anyway; stop sending the others
                if f is not future:
                    f.cancel()

        start = time.monotonic()
        try:
            for i, channel in enumerate(channels):
                future = _wire.update_weights_call(channel).future(
                    recorded(i), timeout=deadline, metadata=self._metadata)
                with lock:
                    futures.append(future)
                future.add_done_callback(on_done)
            responses = []
            for future in futures:
                try:
                    responses.append(future.result())
                except (grpc.RpcError, grpc.FutureCancelledError):
                    pass
            with lock:
                if first:
                    raise first[0] from None
            return _wire.update_result(responses[0], time.monotonic() - start)
        finally:
            for part in parts:
                part.stop(0)
            for channel in channels[1:]:
                channel.close()

    def update_weights_from_ipc(self,
                                named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                                version: str, policy: Optional[str] = "drain", *,
                                skip_tied: bool = True,
                                timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """New weights from this process's GPU tensors, copied by the server device to device
        (a trainer on the server's GPU; CUDA IPC, no bytes cross the host or the socket).

        named_tensors: (name, torch tensor) pairs or a mapping, e.g. model.state_dict().items():
        CUDA tensors on the server's GPU, contiguous, already in the served dtype (bfloat16 for a
        BF16 model; nothing is converted), from torch's caching allocator without expandable
        segments. They must stay alive and unchanged until this returns; the devices are
        synchronized first. torch is imported only here (ImportError saying so without it).
        Answers as update_weights: INVALID_ARGUMENT naming a tensor that is not served, has
        another dtype or shape, or whose handle the server cannot open (freed, another GPU);
        FAILED_PRECONDITION on a server without a CUDA backend (use update_weights) or a
        reused version name with other bytes. policy and skip_tied as in update_weights; the
        result's seconds include exporting the tensors.
        """
        if skip_tied and self.server_info(timeout=timeout).model.tie_word_embeddings:
            named_tensors = _wire.without_tied_lm_head(named_tensors)
        start = time.monotonic()
        with ipc.export_tensors(named_tensors) as exported:
            request = _wire.ipc_request(exported.tensors, version, policy)
            response = self._unary(self._stub.UpdateWeightsFromIpc, request, timeout)
        return _wire.update_result(response, time.monotonic() - start)

    def update_weights_from_path(self, path: str, version: str,
                                 policy: Optional[str] = "drain", *,
                                 timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """Loads weights from a safetensors checkpoint folder on the server's disk."""
        request = _wire.update_from_path_request(path, version, policy)
        start = time.monotonic()
        response = self._unary(self._stub.UpdateWeightsFromPath, request, timeout)
        return _wire.update_result(response, time.monotonic() - start)

    # -- fleets: NCCL weight-sync groups (rollout_client.WeightBroadcaster drives these) -------

    def join_weight_sync_group(self, unique_id: bytes, rank: int, world_size: int, *,
                               group_timeout: float = 0.0,
                               timeout: Timeout = DEFAULT_TIMEOUT) -> WeightSyncGroup:
        """Makes the server rank `rank` of the NCCL group of `world_size` ranks that the
        128-byte ncclUniqueId `unique_id` names (the source's ncclGetUniqueId). Blocks until
        every rank joined (or group_timeout seconds; 0: the server's 60). RolloutError
        FAILED_PRECONDITION from a server that cannot receive broadcasts (cpu backend, no
        --device_weight_staging) or is a member already; DEADLINE_EXCEEDED when the group did
        not form."""
        request = _wire.join_request(unique_id, rank, world_size, group_timeout)
        return message_to_dataclass(
            WeightSyncGroup, self._unary(self._stub.JoinWeightSyncGroup, request, timeout))

    def leave_weight_sync_group(self, *, timeout: Timeout = DEFAULT_TIMEOUT
                                ) -> Optional[WeightSyncGroup]:
        """Leaves the server's weight-sync group; returns what it left (None: it had none)."""
        r = self._unary(self._stub.LeaveWeightSyncGroup, pb2.LeaveWeightSyncGroupRequest(),
                        timeout)
        return WeightSyncGroup(r.rank, r.world_size) if r.was_member else None

    def update_weights_from_broadcast(self, tensors: Sequence[Any], version: str,
                                      policy: Optional[str] = "drain", *,
                                      bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                                      source_rank: int = 0, broadcast_timeout: float = 0.0,
                                      expected_weight_digest: Optional[str] = None,
                                      timeout: Timeout = DEFAULT_TIMEOUT) -> UpdateWeightsResult:
        """Tells the server to receive the tensors that rank `source_rank` of its weight-sync
        group broadcasts -- (name, dtype, shape) or broadcast_plan.TensorSpec, in broadcast
        order, in buckets of bucket_bytes (rollout_client.broadcast_plan lays them out) -- and
        swap them in as update_weights does. Returns once it did (or failed); the bytes must come
        from the source's NCCL meanwhile: WeightBroadcaster.broadcast does both."""
        request = _wire.broadcast_request(tensors, version, policy, bucket_bytes, source_rank,
                                          broadcast_timeout, expected_weight_digest)
        start = time.monotonic()
        response = self._unary(self._stub.UpdateWeightsFromBroadcast, request, timeout)
        return _wire.update_result(response, time.monotonic() - start)

    # -- control ------------------------------------------------------------------------------

    def pause(self, abort_in_flight: bool = False, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        """Stops scheduling (new requests are held, not failed). Returns whether it already was
        paused."""
        r = self._unary(self._stub.Pause, pb2.PauseRequest(abort_in_flight=abort_in_flight),
                        timeout)
        return r.was_paused

    def resume(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> bool:
        """Resumes scheduling. Returns whether it was paused."""
        return self._unary(self._stub.Resume, pb2.ResumeRequest(), timeout).was_paused

    def release_memory(self, weights: bool = False, abort_in_flight: bool = False, *,
                       timeout: Timeout = DEFAULT_TIMEOUT) -> ReleaseMemoryResult:
        """Colocated trainers: the server gives its KV cache's GPU memory (with weights=True
        the weights' too, kept in its host memory) back until resume_memory(). New requests are
        held, not failed; samples in flight are requeued and finish later with the same bits
        (abort_in_flight=True ends them instead). Idempotent. server_info().memory_released
        says what is released."""
        request = pb2.ReleaseMemoryRequest(weights=weights, abort_in_flight=abort_in_flight)
        r = self._unary(self._stub.ReleaseMemory, request, timeout)
        return message_to_dataclass(ReleaseMemoryResult, r)

    def resume_memory(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ResumeMemoryResult:
        """Takes the memory back and serves again, bitwise as before. RolloutError
        RESOURCE_EXHAUSTED when the GPU lacks it (free it, torch.cuda.empty_cache(), and call
        again: the server stays released)."""
        r = self._unary(self._stub.ResumeMemory, pb2.ResumeMemoryRequest(), timeout)
        return message_to_dataclass(ResumeMemoryResult, r)

    def abort(self, request_ids: Union[None, str, Sequence[str]] = None, all: bool = False, *,
              timeout: Timeout = DEFAULT_TIMEOUT) -> AbortResult:
        """Ends in-flight rollouts named by request id (or every one with all=True); their
        generate() calls get completions with finish_reason "abort" and the tokens so far."""
        r = self._unary(self._stub.Abort, _wire.abort_request(request_ids, all), timeout)
        return _wire.abort_result(r)

    def flush_cache(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> FlushCacheResult:
        """Empties the server's prefix cache."""
        r = self._unary(self._stub.FlushCache, pb2.FlushCacheRequest(), timeout)
        return _wire.flush_result(r)

    def server_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> ServerInfo:
        """Model, weight version, backend, engine limits and live counters."""
        r = self._unary(self._stub.GetServerInfo, pb2.GetServerInfoRequest(), timeout)
        return message_to_dataclass(ServerInfo, r)
