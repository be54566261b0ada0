"""Fleet: several rollout servers (replicas) driven as one, for the weight sync of a trainer.

    from rollout_client import Fleet

    with Fleet(["10.0.0.1:50051", "10.0.0.2:50051"], token=TOKEN) as fleet:
        results = fleet.update_weights(model.state_dict().items(), version="step-7")
        for r in results:
            print(r.version, r.bytes_per_second)

update_weights converts every tensor once (in buckets, on one background thread, see
rollout_client._stream) and streams the same encoded bytes to every replica at once, one gRPC
call per replica on its own thread. Each replica validates and swaps on its own: when some fail,
FleetError says which (and what they answered) and which others already serve the new version,
so a retry can target only the failed ones (`fleet.subset(...)`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import _wire
from ._wire import DEFAULT_TIMEOUT, Timeout
from .client import RolloutClient
from .datatypes import RolloutError, ServerInfo, UpdateWeightsResult
from .weights import DTypeSpec

__all__ = ["Fleet", "FleetError"]


class FleetError(RolloutError):
    """Some replicas failed a fleet-wide call. `results[i]` is replica i's result (None where it
    failed), `errors[i]` its error (None where it succeeded), `targets[i]` its address; `code`
    and `message` are those of the first failure, with every failed target listed."""

    def __init__(self, targets: Sequence[str], results: List[Any],
                 errors: List[Optional[BaseException]]):
        failed = [(t, e) for t, e in zip(targets, errors) if e is not None]
        first = failed[0][1]
        code = first.code if isinstance(first, RolloutError) else type(first).__name__
        ok = [t for t, e in zip(targets, errors) if e is None]
        message = "; ".join(f"{t}: {e}" for t, e in failed)
        if ok:
            message += f" (succeeded: {', '.join(ok)})"
        super().__init__(code, f"{len(failed)} of {len(targets)} replicas failed: {message}")
        self.targets = list(targets)
        self.results = results
        self.errors = errors


class Fleet:
    """Replicas of one model, each a RolloutClient (same token, timeout, TLS and options for
    all). A method's timeout= is as RolloutClient's: left out, each client's default deadline;
    None, no deadline."""

    def __init__(self, targets: Sequence[str], token: Optional[str] = None,
                 timeout: Optional[float] = None,
                 tls_root_cert: _wire.PemSource = None,
                 options: Sequence[Tuple[str, Any]] = (), *,
                 tls_client_cert: _wire.PemSource = None,
                 tls_client_key: _wire.PemSource = None):
        targets = list(targets)
        if not targets:
            raise ValueError("Fleet: no targets given")
        if len(set(targets)) != len(targets):
            raise ValueError("Fleet: a target is listed twice")
        self.targets = targets
        self.clients = [RolloutClient(t, token, timeout, tls_root_cert, options,
                                      tls_client_cert=tls_client_cert,
                                      tls_client_key=tls_client_key) for t in targets]

    def subset(self, targets: Iterable[str]) -> "Fleet":
        """A Fleet of some of these replicas (sharing their channels), e.g. the failed ones of
        a FleetError to retry."""
        by_target = dict(zip(self.targets, self.clients))
        sub = Fleet.__new__(Fleet)
        sub.targets = list(targets)
        unknown = [t for t in sub.targets if t not in by_target]
        if unknown:
            raise ValueError(f"Fleet.subset: {unknown} are not in this fleet")
        sub.clients = [by_target[t] for t in sub.targets]
        return sub

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.clients)

    @staticmethod
    def _checked(timeout: Timeout) -> Timeout:
        """`timeout`, checked here: a bad one raises itself, not a FleetError of every replica."""
        if timeout is not DEFAULT_TIMEOUT:
            _wire.check_timeout(timeout)
        return timeout

    def _each(self, call: Callable[[int, RolloutClient], Any]) -> List[Any]:
        """call(i, client) for every replica at once; FleetError if any raised."""
        results: List[Any] = [None] * len(self.clients)
        errors: List[Optional[BaseException]] = [None] * len(self.clients)

        def run(i: int) -> None:
            try:
                results[i] = call(i, self.clients[i])
            except BaseException as e:  # collected, raised below
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                    name=f"rollout-fleet-{i}") for i in range(len(self.clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(e is not None for e in errors):
            raise FleetError(self.targets, results, errors)
        return results

    # -- weights ------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                       version: str, policy: Optional[str] = "drain", *,
                       dtype: DTypeSpec = "BF16", chunk_bytes: int = 4 << 20,
                       bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                       skip_tied: bool = True,
                       timeout: Timeout = DEFAULT_TIMEOUT) -> List[UpdateWeightsResult]:
        """RolloutClient.update_weights on every replica at once, the tensors converted once.
        Returns one UpdateWeightsResult per replica (in target order; seconds and
        bytes_per_second as each replica's call saw them); FleetError if any failed. A
        conversion error (bad tensor) is raised as itself, before or while sending."""
        timeout = self._checked(timeout)
        if skip_tied:
            tied = {i.model.tie_word_embeddings for i in self.server_info(timeout=timeout)}
            if len(tied) != 1:
                raise ValueError("Fleet.update_weights: the replicas disagree on whether lm_head "
                                 "is tied; they serve different models")
            if tied.pop():
                named_tensors = _wire.without_tied_lm_head(named_tensors)
        stream = _wire.weights_stream(named_tensors, version, policy, dtype, chunk_bytes,
                                      bucket_bytes, consumers=len(self.clients))
        conversion: List[BaseException] = []

        def send(i: int, client: RolloutClient) -> UpdateWeightsResult:
            def recorded():
                try:
                    yield from stream.messages(i)
                except GeneratorExit:  # gRPC closing the stream after the call ended: no cause
                    raise
                except BaseException as e:  # the conversion's error, not gRPC's CANCELLED
                    conversion.append(e)
                    raise

            start = time.monotonic()
            try:
                response = _wire.update_weights_call(client._channel)(
                    recorded(), timeout=client._timeout(timeout), metadata=client._metadata)
            except grpc.RpcError as e:
                raise RolloutError.from_rpc_error(e) from None
            finally:
                stream.stop(i)
            return _wire.update_result(response, time.monotonic() - start)

        try:
            return self._each(send)
        except FleetError:
            if conversion:
                raise conversion[0] from None
            raise

    def update_weights_from_path(self, path: str, version: str,
                                 policy: Optional[str] = "drain", *,
                                 timeout: Timeout = DEFAULT_TIMEOUT) -> List[UpdateWeightsResult]:
        """Every replica loads the checkpoint at `path` on its own disk, at once."""
        timeout = self._checked(timeout)
        return self._each(lambda i, c: c.update_weights_from_path(path, version, policy,
                                                                  timeout=timeout))

    # -- control ------------------------------------------------------------------------------

    def pause(self, abort_in_flight: bool = False, *,
              timeout: Timeout = DEFAULT_TIMEOUT) -> List[bool]:
        timeout = self._checked(timeout)
        return self._each(lambda i, c: c.pause(abort_in_flight, timeout=timeout))

    def resume(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> List[bool]:
        timeout = self._checked(timeout)
        return self._each(lambda i, c: c.resume(timeout=timeout))

    def server_info(self, *, timeout: Timeout = DEFAULT_TIMEOUT) -> List[ServerInfo]:
        timeout = self._checked(timeout)
        return self._each(lambda i, c: c.server_info(timeout=timeout))

    def wait_ready(self, timeout: float = 30.0) -> List[ServerInfo]:
        return self._each(lambda i, c: c.wait_ready(timeout))
