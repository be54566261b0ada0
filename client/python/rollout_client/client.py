"""RolloutClient: a typed, blocking Python client of rollout.v1.RolloutService."""

from __future__ import annotations

import numbers
import time
from typing import (Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc

from . import _proto
from .datatypes import (FINISH_REASONS, AbortResult, Completion, FlushCacheResult,
                        RolloutError, ScoreResult, ServerInfo, TokenChunk, TopLogprobs,
                        UpdateWeightsResult, VersionSpan, message_to_dataclass)
from .weights import DTypeSpec, prepare

pb2, pb2_grpc = _proto.load()

DEFAULT_MAX_RECEIVE_BYTES = 256 << 20  # the server sends up to 256 MiB per message
DEFAULT_MAX_SEND_BYTES = 64 << 20      # the server accepts up to 64 MiB per message

_POLICIES = {
    None: pb2.IN_FLIGHT_POLICY_UNSPECIFIED,
    "drain": pb2.IN_FLIGHT_POLICY_DRAIN,
    "abort": pb2.IN_FLIGHT_POLICY_ABORT,
    "continue": pb2.IN_FLIGHT_POLICY_CONTINUE,
}

IntOrList = Union[int, Sequence[int]]


def _policy(policy: Optional[str]) -> int:
    key = policy.lower() if isinstance(policy, str) else policy
    if key not in _POLICIES:
        raise ValueError(f"policy must be 'drain', 'abort' or 'continue' (got {policy!r})")
    return _POLICIES[key]


def _ids(seq: Any, what: str) -> List[int]:
    """A 1-D sequence of token ids (list, tuple, numpy array, torch tensor) as a list of int."""
    if hasattr(seq, "tolist"):
        seq = seq.tolist()
    if isinstance(seq, (int, str, bytes)) or not hasattr(seq, "__iter__"):
        raise TypeError(f"{what} must be a sequence of token ids (got {type(seq).__name__})")
    out = [int(t) for t in seq]
    if any(t < 0 for t in out):
        raise ValueError(f"{what}: token ids must be >= 0")
    return out


def _sequences(seqs: Any, what: str) -> List[List[int]]:
    if hasattr(seqs, "tolist"):
        seqs = seqs.tolist()
    seqs = list(seqs)
    if seqs and isinstance(seqs[0], int):
        raise TypeError(f"{what} must be a list of token-id lists; wrap a single one as [ids]")
    return [_ids(s, f"{what}[{i}]") for i, s in enumerate(seqs)]


def _per_item(value: Any, n: int, name: str) -> List[Any]:
    if hasattr(value, "tolist"):  # numpy / torch values
        value = value.tolist()
    if value is None or isinstance(value, (numbers.Number, str)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} values for {n} items")
    return value


def _top(entries) -> List[TopLogprobs]:
    return [[(e.token_id, e.logprob) for e in tl.entries] for tl in entries]


class RolloutClient:
    """Blocking client of a rollout server. Thread-safe (one gRPC channel, shared).

        with RolloutClient("127.0.0.1:50051") as client:
            client.wait_ready(30)
            groups = client.generate([[1, 2, 3]], num_samples=8, seed=7, max_new_tokens=64)
            for c in groups[0]:
                print(c.token_ids, c.logprobs, c.finish_reason, c.weight_version)

    Failures raise RolloutError(code, message) with the gRPC status code name and the server's
    message; bad Python arguments raise TypeError/ValueError before anything is sent.
    `timeout` (seconds) is the default deadline of every call (None: none); each method also
    takes `timeout=`. `token` is sent as `authorization: Bearer <token>` on every call.
    `tls_root_cert` (a PEM path or PEM bytes) makes the channel TLS; otherwise plaintext.
    """

    def __init__(self, target: str = "127.0.0.1:50051", token: Optional[str] = None,
                 timeout: Optional[float] = None,
                 tls_root_cert: Union[None, str, bytes] = None,
                 options: Sequence[Tuple[str, Any]] = ()):
        self.target = target
        self.timeout = timeout
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        channel_options = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_SEND_BYTES),
        ] + list(options)
        if tls_root_cert is not None:
            if isinstance(tls_root_cert, str):
                with open(tls_root_cert, "rb") as f:
                    tls_root_cert = f.read()
            credentials = grpc.ssl_channel_credentials(root_certificates=tls_root_cert)
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
        else:
            self._channel = grpc.insecure_channel(target, options=channel_options)
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

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _unary(self, method, request, timeout: Optional[float]):
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise RolloutError.from_rpc_error(e) from None

    # -- Generate -----------------------------------------------------------------------------

    def _generate_request(self, prompts, num_samples, seed, temperature, top_k, top_p, min_p,
                          max_new_tokens, stop_token_ids, ignore_eos, top_logprobs, request_ids):
        if max_new_tokens is None:
            raise TypeError("generate: max_new_tokens is required")
        prompts = _sequences(prompts, "prompts")
        n = len(prompts)
        seeds = _per_item(seed, n, "seed")
        samples = _per_item(num_samples, n, "num_samples")
        ids = _per_item(request_ids, n, "request_ids")
        stop = [int(t) for t in stop_token_ids]
        request = pb2.GenerateRequest()
        for i, prompt in enumerate(prompts):
            r = request.rollouts.add()
            if ids[i] is not None:
                r.request_id = str(ids[i])
            r.prompt_token_ids.extend(prompt)
            r.seed = int(seeds[i])
            r.num_samples = int(samples[i])
            s = r.sampling
            if temperature is not None:
                s.temperature = float(temperature)
            if top_k is not None:
                s.top_k = int(top_k)
            if top_p is not None:
                s.top_p = float(top_p)
            if min_p is not None:
                s.min_p = float(min_p)
            s.max_new_tokens = int(max_new_tokens)
            s.stop_token_ids.extend(stop)
            s.ignore_eos = bool(ignore_eos)
            s.top_logprobs = int(top_logprobs)
        return request, [("" if x is None else str(x)) for x in ids]

    @staticmethod
    def _completion(c, request_ids: List[str]) -> Completion:
        return Completion(
            prompt_index=c.rollout_index,
            sample_index=c.sample_index,
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            finish_reason=FINISH_REASONS.get(c.finish_reason, str(c.finish_reason)),
            weight_version=c.weight_version,
            version_spans=[VersionSpan(v.version, v.first_token, v.last_token)
                           for v in c.version_spans],
            sample_seed=c.sample_seed,
            cached_prompt_tokens=c.cached_prompt_tokens,
            top_logprobs=_top(c.top_logprobs),
            request_id=request_ids[c.rollout_index] if c.rollout_index < len(request_ids) else "",
        )

    def _stream(self, request, request_ids, timeout) -> Iterator[Union[TokenChunk, Completion]]:
        call = self._stub.Generate(request, timeout=self._timeout(timeout),
                                   metadata=self._metadata)
        done = False
        try:
            for response in call:
                kind = response.WhichOneof("item")
                if kind == "chunk":
                    c = response.chunk
                    yield TokenChunk(c.rollout_index, c.sample_index, list(c.token_ids),
                                     list(c.logprobs), _top(c.top_logprobs))
                elif kind == "completion":
                    yield self._completion(response.completion, request_ids)
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
                 stream: bool = False, timeout: Optional[float] = None):
        """Samples completions of token-id prompts.

        prompts: a list of prompts, each a sequence of token ids (lists, numpy arrays, torch
        tensors; a 2-D array/tensor is a batch of equal-length prompts).
        seed, num_samples, request_ids: one value for every prompt, or a list with one per
        prompt. Sample j of a prompt with seed s uses the seed sample_seed(s, j) (see
        docs/api.md), reported as Completion.sample_seed; sample 0 uses s itself.
        Sampling options apply to every prompt; None leaves the server default (temperature
        1.0, top_k off, top_p 1.0, min_p 0). temperature=0 is greedy.

        Returns completions[prompt_index][sample_index] (a list of lists of Completion). With
        stream=True returns an iterator over TokenChunk and Completion objects as the server
        sends them (chunks of one sample concatenate to its completion; stopping the iteration
        early cancels the call, which aborts the samples).
        """
        request, ids = self._generate_request(
            prompts, num_samples, seed, temperature, top_k, top_p, min_p, max_new_tokens,
            stop_token_ids, ignore_eos, top_logprobs, request_ids)
        if stream:
            return self._stream(request, ids, timeout)
        results: List[List[Optional[Completion]]] = [
            [None] * max(1, r.num_samples) for r in request.rollouts]
        for item in self._stream(request, ids, timeout):
            if isinstance(item, Completion):
                results[item.prompt_index][item.sample_index] = item
        for i, row in enumerate(results):
            for j, c in enumerate(row):
                if c is None:
                    raise RolloutError("INTERNAL",
                                       f"the stream ended without a completion of prompt {i} "
                                       f"sample {j}", grpc.StatusCode.INTERNAL)
        return results

    # -- Score --------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]], starts: IntOrList,
              temperature: Union[None, float, Sequence[Optional[float]]] = None,
              top_logprobs: int = 0, *, details: bool = False,
              timeout: Optional[float] = None):
        """Teacher-forced logprobs of token_ids[start:] of each sequence (prompt + completion
        with start = len(prompt) gives exactly the logprobs Generate returned, bitwise, at the
        same temperature and weights).

        Returns a list (per sequence) of logprob lists; with details=True a list of
        ScoreResult (logprobs, top_logprobs, weight_version, cached_tokens).
        """
        seqs = _sequences(sequences, "sequences")
        starts_list = _per_item(starts, len(seqs), "starts")
        temps = _per_item(temperature, len(seqs), "temperature")
        request = pb2.ScoreRequest()
        for ids, start, t in zip(seqs, starts_list, temps):
            s = request.sequences.add()
            s.token_ids.extend(ids)
            s.start = int(start)
            if t is not None:
                s.temperature = float(t)
            s.top_logprobs = int(top_logprobs)
        response = self._unary(self._stub.Score, request, timeout)
        if not details:
            return [list(r.logprobs) for r in response.results]
        return [ScoreResult(list(r.logprobs), _top(r.top_logprobs), r.weight_version,
                            r.cached_tokens) for r in response.results]

    # -- weights ------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                       version: str, policy: Optional[str] = "drain", *,
                       dtype: DTypeSpec = "BF16", chunk_bytes: int = 4 << 20,
                       timeout: Optional[float] = None) -> UpdateWeightsResult:
        """Streams new weights to the server: a WeightsHeader declaring every tensor, then each
        tensor's bytes in TensorData chunks of at most chunk_bytes. Nothing changes on the
        server until every byte arrived and was validated; then it swaps atomically.

        named_tensors: (name, tensor) pairs or a mapping, e.g. model.state_dict().items() with
        Hugging Face names; tensors as torch tensors, numpy arrays or RawTensor (see
        rollout_client.weights). dtype: the served dtype the values are converted to ("BF16",
        "F16", "F32"; a mapping name -> dtype or a callable for mixed models; None sends each
        tensor in its own dtype). A wrong dtype or shape is answered INVALID_ARGUMENT naming
        what the server expects. policy: what happens to samples in flight: "drain" (finish on
        the old weights first), "abort" or "continue" (go on with the new weights; see
        Completion.version_spans).
        """
        if not version:
            raise ValueError("update_weights: version must be non-empty")
        if chunk_bytes <= 0:
            raise ValueError("update_weights: chunk_bytes must be > 0")
        tensors = prepare(named_tensors, dtype)
        header = pb2.WeightsHeader(version=str(version), policy=_policy(policy))
        for t in tensors:
            header.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape))
        failure: List[BaseException] = []

        def chunks():
            try:
                yield pb2.WeightsChunk(header=header)
                for t in tensors:
                    data = t.payload()
                    for offset in range(0, data.nbytes, chunk_bytes):
                        yield pb2.WeightsChunk(data=pb2.TensorData(
                            name=t.name, offset=offset,
                            data=data[offset:offset + chunk_bytes].tobytes()))
                    del data
            except BaseException as e:  # surfaced below instead of gRPC's CANCELLED
                failure.append(e)
                raise

        try:
            response = self._stub.UpdateWeights(chunks(), timeout=self._timeout(timeout),
                                                metadata=self._metadata)
        except grpc.RpcError as e:
            if failure:
                raise failure[0] from None
            raise RolloutError.from_rpc_error(e) from None
        return message_to_dataclass(UpdateWeightsResult, response)

    def update_weights_from_path(self, path: str, version: str,
                                 policy: Optional[str] = "drain", *,
                                 timeout: Optional[float] = None) -> UpdateWeightsResult:
        """Loads weights from a safetensors checkpoint folder on the server's disk."""
        request = pb2.UpdateWeightsFromPathRequest(path=str(path), version=str(version),
                                                   policy=_policy(policy))
        response = self._unary(self._stub.UpdateWeightsFromPath, request, timeout)
        return message_to_dataclass(UpdateWeightsResult, response)

    # -- control ------------------------------------------------------------------------------

    def pause(self, abort_in_flight: bool = False, *, timeout: Optional[float] = None) -> bool:
        """Stops scheduling (new requests are held, not failed). Returns whether it already was
        paused."""
        r = self._unary(self._stub.Pause, pb2.PauseRequest(abort_in_flight=abort_in_flight),
                        timeout)
        return r.was_paused

    def resume(self, *, timeout: Optional[float] = None) -> bool:
        """Resumes scheduling. Returns whether it was paused."""
        return self._unary(self._stub.Resume, pb2.ResumeRequest(), timeout).was_paused

    def abort(self, request_ids: Union[None, str, Sequence[str]] = None, all: bool = False, *,
              timeout: Optional[float] = None) -> AbortResult:
        """Ends in-flight rollouts named by request id (or every one with all=True); their
        generate() calls get completions with finish_reason "abort" and the tokens so far."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        request = pb2.AbortRequest(request_ids=list(request_ids or ()), all=all)
        r = self._unary(self._stub.Abort, request, timeout)
        return AbortResult(r.aborted_rollouts, list(r.unknown_request_ids))

    def flush_cache(self, *, timeout: Optional[float] = None) -> FlushCacheResult:
        """Empties the server's prefix cache."""
        r = self._unary(self._stub.FlushCache, pb2.FlushCacheRequest(), timeout)
        return FlushCacheResult(r.freed_blocks, r.detached_blocks)

    def server_info(self, *, timeout: Optional[float] = None) -> ServerInfo:
        """Model, weight version, backend, engine limits and live counters."""
        r = self._unary(self._stub.GetServerInfo, pb2.GetServerInfoRequest(), timeout)
        return message_to_dataclass(ServerInfo, r)
