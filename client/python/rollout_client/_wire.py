"""What the blocking and the asyncio client share: the channel and call metadata they open,
Python arguments -> request messages, and response messages -> the package's dataclasses.
No calls are made here."""

from __future__ import annotations

import enum
import numbers
import operator
import os
from typing import (Any, Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc

from . import _proto, broadcast_plan, ipc
from .datatypes import (FINISH_REASONS, AbortResult, Completion, FlushCacheResult, ScoreResult,
                        TokenChunk, TopLogprobs, UpdateWeightsResult, VersionSpan,
                        message_to_dataclass)
from ._stream import SharedStream
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


def channel_options(options: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", DEFAULT_MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", DEFAULT_MAX_SEND_BYTES),
    ] + list(options)


PemSource = Union[None, str, bytes, os.PathLike]  # a PEM file's path, or the PEM


def channel_credentials(tls_root_cert: PemSource = None, tls_client_cert: PemSource = None,
                        tls_client_key: PemSource = None) -> Optional[grpc.ChannelCredentials]:
    """The credentials of a client's channels: TLS trusting `tls_root_cert`, presenting
    `tls_client_cert` with its `tls_client_key` to a server that verifies clients (mutual TLS,
    its --tls_client_ca); None (plaintext) without any. Each is a PEM path or PEM bytes, read
    here, once. A client certificate turns TLS on by itself: without tls_root_cert the server
    is checked against gRPC's default roots (as rollout-cli does). ValueError for a client
    certificate without its key (or the key without the certificate); OSError naming a file
    that cannot be read."""
    has_cert, has_key = tls_client_cert is not None, tls_client_key is not None
    # Either alone would fail the handshake later with an obscure message; say so now.
    if has_cert != has_key:
        raise ValueError("tls_client_cert (the client's certificate chain) needs "
                         "tls_client_key (its private key) as well" if has_cert else
                         "tls_client_key (a private key) needs tls_client_cert (its certificate "
                         "chain) as well")
    if tls_root_cert is None and not has_cert:
        return None
    root = None if tls_root_cert is None else read_pem(tls_root_cert, "tls_root_cert")
    if not has_cert:
        return grpc.ssl_channel_credentials(root_certificates=root)
    chain = read_pem(tls_client_cert, "tls_client_cert")
    key = read_pem(tls_client_key, "tls_client_key")
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                        certificate_chain=chain)


def open_channel(grpc_module: Any, target: str, credentials: Optional[grpc.ChannelCredentials],
                 options: Sequence[Tuple[str, Any]]) -> Any:
    """A channel to `target` from `grpc_module` (grpc, or grpc.aio for the asyncio client):
    TLS with `credentials` (channel_credentials), else plaintext."""
    channel_opts = channel_options(options)
    if credentials is None:
        return grpc_module.insecure_channel(target, options=channel_opts)
    return grpc_module.secure_channel(target, credentials, options=channel_opts)


_TOKEN_SPACE = " \t\n\v\f\r"  # what the server strips around its token (absl's ASCII space)


def bearer_metadata(token: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    """The metadata every call carries: `authorization: Bearer <token>`, or none (token None or
    ""). The token's line end and surrounding whitespace are left out, as the server and
    rollout-cli read --auth_token_file (docs/operations.md, "One spelling for the token"): so
    token=open(path).read() works. ValueError naming `token` for what gRPC metadata cannot carry
    (e.g. a line end inside it); the message never shows the token."""
    if token is None:
        return ()
    if not isinstance(token, str):
        raise TypeError(f"token must be a str (got {type(token).__name__})")
    if not token:
        return ()
    stripped = token.strip(_TOKEN_SPACE)
    if not stripped:
        raise ValueError("token holds only whitespace or a line end (an empty token file?)")
    for i, ch in enumerate(stripped):
        if not " " <= ch <= "~":
            raise ValueError(f"token: character {ord(ch):#04x} at index {i} cannot go in gRPC "
                             "metadata (printable ASCII only); was a whole file given instead of "
                             "its first line?")
    return (("authorization", f"Bearer {stripped}"),)


def read_pem(source: PemSource, what: str) -> bytes:
    """The PEM of `source` (a path, or the PEM bytes themselves); `what` names the parameter in
    errors. An empty one is refused: gRPC would take an empty root PEM for "the default roots"
    and an empty client certificate for "none", neither of which a caller naming it asked for."""
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise ValueError(f"{what} is empty (PEM bytes expected, or a PEM file's path)")
        return bytes(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{what} must be a PEM file's path or PEM bytes "
                        f"(got {type(source).__name__})")
    path = os.fspath(source)
    if not path:
        raise ValueError(f"{what} is an empty path (give a PEM file's path or PEM bytes; None "
                         "for none)")
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise OSError(e.errno, f"cannot read the {what} file {path}: {e.strerror}") from None
    if not pem:
        raise ValueError(f"the {what} file {path} is empty")
    return pem


def policy(value: Optional[str]) -> int:
    key = value.lower() if isinstance(value, str) else value
    if key not in _POLICIES:
        raise ValueError(f"policy must be 'drain', 'abort' or 'continue' (got {value!r})")
    return _POLICIES[key]


_ID_BOUND = 1 << 32  # ids are uint32 on the wire


def integer(value: Any, name: str, bits: int = 32, signed: bool = False) -> int:
    """`value` as an int in the range of a proto (u)int`bits` field: TypeError naming `name` for
    anything but an integer (Python int, numpy integer, an integer 0-d tensor; not bool, not a
    float even when whole), ValueError naming `name` and the bound outside the range."""
    if isinstance(value, bool) or _dtype_kind(value) == "b":
        raise TypeError(f"{name} must be an integer (got bool {value!r})")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer (got {type(value).__name__} "
                        f"{value!r})") from None
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    if not lo <= v < hi:
        bounds = f"[-2**{bits - 1}, 2**{bits - 1})" if signed else f"[0, 2**{bits})"
        raise ValueError(f"{name} = {v} is out of range: it must be in {bounds}")
    return v


def number(value: Any, name: str) -> float:
    """`value` as a float, for a proto float field: TypeError naming `name` for anything but one
    real number (Python int or float, numpy integer or floating scalar, a 0-d array or tensor
    of them; not bool, not a string, not complex, not a list or a larger array). Its value is
    the server's to check (docs/api.md, "Sampling parameters and defaults")."""
    kind = _dtype_kind(value)
    if isinstance(value, bool) or kind == "b":
        raise TypeError(f"{name} must be a number (got bool {value!r})")
    shape = tuple(getattr(value, "shape", None) or ())
    if shape:
        raise TypeError(f"{name} must be a number (got an array of shape {list(shape)})")
    if (isinstance(value, (str, bytes, bytearray, complex)) or kind not in (None, "i", "u", "f")
            or not hasattr(value, "__float__")):
        raise TypeError(f"{name} must be a number (got {type(value).__name__} {value!r})")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number (got {type(value).__name__} "
                        f"{value!r})") from None
    except OverflowError:
        raise ValueError(f"{name} = {value} is out of range: it must fit a float") from None


class _Default(enum.Enum):
    """The type of DEFAULT_TIMEOUT (an enum: one value, the same after copy and pickle)."""
    TIMEOUT = "the client's default deadline"

    def __repr__(self) -> str:
        return "DEFAULT_TIMEOUT"


# A call's `timeout` when none is given: the client's default deadline (its constructor's
# `timeout`). None is no deadline; a number, that many seconds.
DEFAULT_TIMEOUT = _Default.TIMEOUT
Timeout = Union[None, float, _Default]


MAX_TIMEOUT = 1e9  # seconds (31 years): gRPC reads one past ~7e9 s (2**63 ns from now) as past


def check_timeout(timeout: Optional[float], name: str = "timeout") -> Optional[float]:
    """A deadline in seconds: None (no deadline) or a number in (0, MAX_TIMEOUT] (gRPC reads
    0 or less, NaN, infinity and a deadline beyond its clock as one already past: the call
    would fail DEADLINE_EXCEEDED at once). TypeError/ValueError naming `name`."""
    if timeout is None:
        return None
    seconds = number(timeout, name)
    if not 0 < seconds <= MAX_TIMEOUT:  # NaN too
        raise ValueError(f"{name} = {timeout!r}: a deadline is a positive number of seconds up "
                         f"to {MAX_TIMEOUT:g} (None: no deadline)")
    return seconds


def deadline(default: Optional[float], timeout: Timeout) -> Optional[float]:
    """The gRPC timeout of a call given `timeout`: the client's `default` for DEFAULT_TIMEOUT (a
    call that gives none), no deadline for None, else `timeout` seconds (checked)."""
    if timeout is DEFAULT_TIMEOUT:
        return default
    return check_timeout(timeout)


def _dtype_kind(x: Any) -> Optional[str]:
    """numpy's dtype kind of an array or tensor x ('i', 'u', 'f', 'b', ...; torch dtypes
    mapped to the same letters), or None for what has no dtype. torch is never imported."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    kind = getattr(dtype, "kind", None)  # numpy (and what uses numpy's dtypes: jax, cupy)
    if isinstance(kind, str):
        return kind
    if getattr(dtype, "is_floating_point", False):  # torch
        return "f"
    if getattr(dtype, "is_complex", False):
        return "c"
    if str(dtype) == "torch.bool":
        return "b"
    return "i" if str(dtype).startswith(("torch.int", "torch.uint")) else "?"


def _id_error(what: str, j: int, t: Any, noun: str, kind: str = "") -> Exception:
    """The error of element j of `what`, t: not an integer, or out of [0, 2**32)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        shown = repr(t) if isinstance(t, (str, bytes)) else str(t)  # numpy 2's repr: np.float64(..)
        return TypeError(f"{what}[{j}] = {shown}: {noun} must be integers, not "
                         f"{kind or type(t).__name__}")
    bound = "must be >= 0" if t < 0 else f"must be < 2**32 ({_ID_BOUND})"
    return ValueError(f"{what}[{j}] = {t}: {noun} {bound}")


def _list_ids(seq: Any, what: str, noun: str) -> List[int]:
    out = list(seq)
    # The common case in C: Python ints only (not bool: its type is not int), in range.
    if set(map(type, out)) <= {int} and (not out or (min(out) >= 0 and max(out) < _ID_BOUND)):
        return out
    for j, t in enumerate(out):
        if type(t) is not int:
            if isinstance(t, bool) or _dtype_kind(t) == "b":
                raise _id_error(what, j, t, noun, "bool")
            try:
                t = operator.index(t)  # numpy integers, integer 0-d tensors
            except TypeError:
                raise _id_error(what, j, t, noun) from None
            out[j] = t
        if not 0 <= t < _ID_BOUND:
            raise _id_error(what, j, t, noun)
    return out


def _lists_ids(values: Any, what: str, noun: str, batch: bool) -> Any:
    """An array's values (its tolist()) checked element by element."""
    if batch:
        return [_list_ids(row, f"{what}[{i}]", noun) for i, row in enumerate(values)]
    return _list_ids(values, what, noun)


def _array_ids(a: Any, what: str, noun: str, batch: bool) -> Union[List[int], List[List[int]]]:
    """The ids of a numpy array or torch tensor (1-D; 2-D, a batch of rows, when `batch`),
    checked vectorised: its dtype's kind, then its min and max."""
    shape = tuple(a.shape)
    if len(shape) != (2 if batch else 1):
        raise TypeError(f"{what} must be a {'2' if batch else '1'}-D array of {noun} (got shape "
                        f"{shape}){'' if batch or shape else '; wrap a single id as [id]'}")
    kind = _dtype_kind(a)
    if kind == "O":  # numpy's Python objects: each checked as a list's
        return _lists_ids(a.tolist(), what, noun, batch)
    count = 1
    for d in shape:
        count *= int(d)
    if count == 0:
        return a.tolist()
    cols = int(shape[-1])

    def where(flat: int) -> Tuple[str, int]:
        return (f"{what}[{flat // cols}]", flat % cols) if batch else (what, flat)

    if kind not in ("i", "u"):
        flat = a.reshape(-1)
        values = flat.tolist()  # the error's path: the first value that is not whole, if any
        k = next((k for k, v in enumerate(values)
                  if not isinstance(v, (int, float)) or v != v or v % 1), 0)
        w, j = where(k)
        first = flat[k] if isinstance(getattr(a.dtype, "kind", None), str) else values[k]
        raise TypeError(f"{w}[{j}] = {str(first)}: {noun} must be integers, not an array of "
                        f"{a.dtype}" + (" (refused, not truncated: give an integer dtype)"
                                        if kind == "f" else ""))
    try:
        lo, hi = int(a.min()), int(a.max())
    except (RuntimeError, TypeError, NotImplementedError):  # e.g. a torch uint32 without min
        return _lists_ids(a.tolist(), what, noun, batch)
    if lo < 0 or hi >= _ID_BOUND:
        k = int(a.argmin()) if lo < 0 else int(a.argmax())  # an index into the flat array
        w, j = where(k)
        raise _id_error(w, j, lo if lo < 0 else hi, noun)
    return a.tolist()


def _is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and hasattr(x, "tolist")


def ids(seq: Any, what: str, noun: str = "token ids") -> List[int]:
    """A 1-D sequence of ids (list, tuple, numpy array, torch tensor) as a list of int, each in
    [0, 2**32). TypeError naming `what`, the element's index and its value for a non-integer
    (a float, even a whole one; a bool; a float array or tensor), ValueError for one out of
    range. Arrays and tensors are checked vectorised (dtype, min, max), lists in one pass."""
    if _is_array(seq):
        return _array_ids(seq, what, noun, batch=False)  # type: ignore[return-value]
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
        raise TypeError(f"{what} must be a sequence of {noun} (got {type(seq).__name__})")
    return _list_ids(seq, what, noun)


def sequences(seqs: Any, what: str) -> List[List[int]]:
    """A batch of token-id sequences (a list of them, or a 2-D array or tensor) as lists of
    int, checked as `ids` checks one (what[i][j] in errors)."""
    if _is_array(seqs):
        if len(tuple(seqs.shape)) == 1:
            raise TypeError(f"{what} must be a list of token-id lists; wrap a single one as [ids]")
        return _array_ids(seqs, what, "token ids", batch=True)  # type: ignore[return-value]
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise TypeError(f"{what} must be a list of token-id lists (got {type(seqs).__name__})")
    seqs = list(seqs)
    if seqs and isinstance(seqs[0], numbers.Number):
        raise TypeError(f"{what} must be a list of token-id lists; wrap a single one as [ids]")
    return [ids(s, f"{what}[{i}]") for i, s in enumerate(seqs)]


def per_item(value: Any, n: int, name: str,
             check: Optional[Callable[[Any, str], Any]] = None) -> List[Any]:
    """One value per item: `value` for all of them, or its n values; `check(v, name)` (e.g.
    integer) converts each, named `name` or `name[i]`."""
    if hasattr(value, "tolist"):  # numpy / torch values
        value = value.tolist()
    if value is None or isinstance(value, (numbers.Number, str)):
        return [value if check is None else check(value, name)] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} values for {n} items")
    if check is not None:
        value = [check(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return value


def _top(entries) -> List[TopLogprobs]:
    return [[(e.token_id, e.logprob) for e in tl.entries] for tl in entries]


# -- Generate ---------------------------------------------------------------------------------


def generate_request(prompts, num_samples, seed, temperature, top_k, top_p, min_p,
                     max_new_tokens, stop_token_ids, ignore_eos, top_logprobs, request_ids,
                     completions_only: bool = False, chunk_tokens: int = 0,
                     chunk_interval_ms: int = 0, return_routing: bool = False):
    """The GenerateRequest, and the request id of each rollout ("" when none). Every argument
    is checked here (integers in their field's range, token ids integers in [0, 2**32),
    temperature, top_p and min_p numbers), so a bad one raises TypeError/ValueError naming it
    before anything is sent."""
    if max_new_tokens is None:
        raise TypeError("generate: max_new_tokens is required")
    if completions_only and (chunk_tokens or chunk_interval_ms):
        raise ValueError("generate: completions_only excludes chunk_tokens and chunk_interval_ms")

    def uint(bits: int) -> Callable[[Any, str], int]:
        return lambda v, name: integer(v, f"generate: {name}", bits)

    chunk_tokens = uint(32)(chunk_tokens, "chunk_tokens")
    chunk_interval_ms = uint(32)(chunk_interval_ms, "chunk_interval_ms")
    max_new_tokens = uint(32)(max_new_tokens, "max_new_tokens")
    top_logprobs = uint(32)(top_logprobs, "top_logprobs")
    if top_k is not None:
        top_k = integer(top_k, "generate: top_k", 32, signed=True)
    if temperature is not None:
        temperature = number(temperature, "generate: temperature")
    if top_p is not None:
        top_p = number(top_p, "generate: top_p")
    if min_p is not None:
        min_p = number(min_p, "generate: min_p")
    prompts = sequences(prompts, "prompts")
    n = len(prompts)
    seeds = per_item(seed, n, "seed", uint(64))
    samples = per_item(num_samples, n, "num_samples", uint(32))
    ids_ = per_item(request_ids, n, "request_ids")
    stop = ids(stop_token_ids, "stop_token_ids")
    request = pb2.GenerateRequest()
    request.stream.completions_only = bool(completions_only)
    request.stream.chunk_tokens = chunk_tokens
    request.stream.chunk_interval_ms = chunk_interval_ms
    request.return_routing = bool(return_routing)
    for i, prompt in enumerate(prompts):
        r = request.rollouts.add()
        if ids_[i] is not None:
            r.request_id = str(ids_[i])
        r.prompt_token_ids.extend(prompt)
        r.seed = seeds[i]
        r.num_samples = samples[i]
        s = r.sampling
        if temperature is not None:
            s.temperature = temperature
        if top_k is not None:
            s.top_k = top_k
        if top_p is not None:
            s.top_p = top_p
        if min_p is not None:
            s.min_p = min_p
        s.max_new_tokens = max_new_tokens
        s.stop_token_ids.extend(stop)
        s.ignore_eos = bool(ignore_eos)
        s.top_logprobs = top_logprobs
    return request, [("" if x is None else str(x)) for x in ids_]


def completion(c, request_ids: List[str]) -> Completion:
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
        weight_digest=c.weight_digest,
        routing=list(c.routing),
        abort_cause=c.abort_cause,
    )


def stream_item(response, request_ids: List[str]) -> Union[None, TokenChunk, Completion]:
    """The dataclass of one GenerateResponse; None for a kind this client does not know."""
    kind = response.WhichOneof("item")
    if kind == "chunk":
        c = response.chunk
        return TokenChunk(c.rollout_index, c.sample_index, list(c.token_ids), list(c.logprobs),
                          _top(c.top_logprobs))
    if kind == "completion":
        return completion(response.completion, request_ids)
    return None


class CompletionTable:
    """Arranges a stream's completions as completions[prompt][sample]."""

    def __init__(self, request):
        self.rows: List[List[Optional[Completion]]] = [
            [None] * max(1, r.num_samples) for r in request.rollouts]

    def add(self, item) -> None:
        if isinstance(item, Completion):
            self.rows[item.prompt_index][item.sample_index] = item

    def result(self, error) -> List[List[Completion]]:
        """The table; `error(message)` makes the exception for a sample without completion."""
        for i, row in enumerate(self.rows):
            for j, c in enumerate(row):
                if c is None:
                    raise error(f"the stream ended without a completion of prompt {i} "
                                f"sample {j}")
        return self.rows  # type: ignore[return-value]


# -- Score ------------------------------------------------------------------------------------


def score_request(sequences_, starts, temperature, top_logprobs, routings=None,
                  return_routing: bool = False):
    """The ScoreRequest; arguments checked as generate_request checks its own."""
    seqs = sequences(sequences_, "sequences")
    starts_list = per_item(starts, len(seqs), "starts",
                           lambda v, name: integer(v, f"score: {name}"))
    temps = per_item(temperature, len(seqs), "temperature",
                     lambda v, name: None if v is None else number(v, f"score: {name}"))
    top_logprobs = integer(top_logprobs, "score: top_logprobs")
    if routings is None:
        routings = [None] * len(seqs)
    elif len(routings) != len(seqs):
        raise ValueError(f"score: routings has {len(routings)} entries for {len(seqs)} sequences")
    request = pb2.ScoreRequest()
    for i, (token_ids, start, t, routing) in enumerate(zip(seqs, starts_list, temps, routings)):
        s = request.sequences.add()
        s.token_ids.extend(token_ids)
        s.start = start
        if t is not None:
            s.temperature = t
        s.top_logprobs = top_logprobs
        if routing is not None:
            s.routing.extend(ids(routing, f"routings[{i}]", "expert ids"))
        s.return_routing = bool(return_routing)
    return request


def score_results(response, details: bool):
    if not details:
        return [list(r.logprobs) for r in response.results]
    return [ScoreResult(list(r.logprobs), _top(r.top_logprobs), r.weight_version,
                        r.cached_tokens, r.weight_digest, list(r.routing))
            for r in response.results]


# -- weights ----------------------------------------------------------------------------------


TIED_LM_HEAD = "lm_head.weight"


def without_tied_lm_head(named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]]
                         ) -> Iterator[Tuple[str, Any]]:
    """The (name, tensor) pairs but lm_head.weight: what a model that ties lm_head to the
    embedding serves (its state_dict still lists the shared tensor under both names)."""
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return ((name, t) for name, t in pairs if name != TIED_LM_HEAD)


DEFAULT_BUCKET_BYTES = 256 << 20


def weights_stream(named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                   version: str, policy_name: Optional[str], dtype: DTypeSpec,
                   chunk_bytes: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   consumers: int = 1) -> SharedStream:
    """The UpdateWeights stream, encoded: a WeightsHeader, then each tensor's bytes in
    TensorData chunks of at most chunk_bytes, converted in buckets of about bucket_bytes on a
    background thread (rollout_client._stream). Every argument is checked here, before a call."""
    if not version:
        raise ValueError("update_weights: version must be non-empty")
    chunk_bytes = integer(chunk_bytes, "update_weights: chunk_bytes", 64, signed=True)
    bucket_bytes = integer(bucket_bytes, "update_weights: bucket_bytes", 64, signed=True)
    if chunk_bytes <= 0:
        raise ValueError("update_weights: chunk_bytes must be > 0")
    if chunk_bytes > DEFAULT_MAX_SEND_BYTES - (1 << 20):
        raise ValueError(f"update_weights: chunk_bytes must be at most "
                         f"{DEFAULT_MAX_SEND_BYTES - (1 << 20)} (the server takes messages of up "
                         f"to {DEFAULT_MAX_SEND_BYTES >> 20} MiB)")
    if bucket_bytes <= 0:
        raise ValueError("update_weights: bucket_bytes must be > 0")
    tensors = prepare(named_tensors, dtype)
    header = pb2.WeightsHeader(version=str(version), policy=policy(policy_name))
    for t in tensors:
        header.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape))
    return SharedStream(pb2.WeightsChunk(header=header).SerializeToString(), tensors,
                        consumers=consumers, bucket_bytes=bucket_bytes, chunk_bytes=chunk_bytes)


MAX_STREAMS = 64  # the server takes up to 64 parts


def split_by_bytes(nbytes: Sequence[int], parts: int) -> List[List[int]]:
    """The tensors (indices into nbytes) of each part of a multi-stream update, as the C++
    client splits them (rollout::SplitByBytes): largest first (ties by index), each into the part
    with the fewest bytes so far (ties: the lowest part), then each part in index order. No part
    is empty: fewer parts when there are fewer tensors."""
    count = min(max(parts, 1), max(len(nbytes), 1))
    split: List[List[int]] = [[] for _ in range(count)]
    load = [0] * count
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):  # sorted() is stable
        lightest = load.index(min(load))
        split[lightest].append(i)
        load[lightest] += nbytes[i]
    return [sorted(part) for part in split]


def weights_part_streams(named_tensors, version: str, policy_name: Optional[str],
                         dtype: DTypeSpec, chunk_bytes: int, bucket_bytes: int,
                         streams: int) -> List[SharedStream]:
    """The UpdateWeights streams of one update spread over `streams` parts (docs/api.md, "One
    update over several streams"): each declares its share of the tensors (split_by_bytes) and
    the same fresh update_id; one stream, as weights_stream, when streams is 1 or there is one
    tensor."""
    streams = integer(streams, "update_weights: streams", 32, signed=True)
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"update_weights: streams = {streams!r}; give 1 to {MAX_STREAMS}")
    stream = weights_stream(named_tensors, version, policy_name, dtype, chunk_bytes, bucket_bytes)
    tensors = stream._tensors
    split = split_by_bytes([t.nbytes for t in tensors], streams)
    if len(split) == 1:
        return [stream]
    # A new name per attempt: a stray part of an earlier one never joins this one.
    update_id = f"{str(version)[:64]}/{os.urandom(8).hex()}"
    out = []
    for index, part in enumerate(split):
        header = pb2.WeightsHeader(version=str(version), policy=policy(policy_name),
                                   update_id=update_id, part_index=index,
                                   part_count=len(split))
        subset = [tensors[i] for i in part]
        for t in subset:
            header.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape))
        out.append(SharedStream(pb2.WeightsChunk(header=header).SerializeToString(), subset,
                                consumers=1, bucket_bytes=bucket_bytes,
                                chunk_bytes=chunk_bytes))
    return out


def weights_messages(named_tensors, version, policy_name, dtype, chunk_bytes,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[Any]:
    """The same stream as parsed WeightsChunk messages (for callers of the raw stub)."""
    stream = weights_stream(named_tensors, version, policy_name, dtype, chunk_bytes, bucket_bytes)
    return (pb2.WeightsChunk.FromString(m) for m in stream.messages(0))


def update_weights_call(channel: Any):
    """UpdateWeights taking requests already encoded (bytes, sent as they are)."""
    return channel.stream_unary("/rollout.v1.RolloutService/UpdateWeights",
                                request_serializer=None,
                                response_deserializer=pb2.UpdateWeightsResponse.FromString)


def update_result(response, seconds: float):
    """UpdateWeightsResult of a response, with the client's wall time of the call."""
    r = message_to_dataclass(UpdateWeightsResult, response)
    r.seconds = seconds
    r.bytes_per_second = r.bytes_received / seconds if seconds > 0 else 0.0
    return r


def ipc_request(tensors: Sequence[Any], version: str, policy_name: Optional[str]):
    """An UpdateWeightsFromIpcRequest of ipc.IpcTensor values."""
    if not version:
        raise ValueError("update_weights_from_ipc: version must be non-empty")
    request = pb2.UpdateWeightsFromIpcRequest(version=str(version), policy=policy(policy_name))
    for t in tensors:
        request.tensors.add(**ipc.request_fields(t))
    return request


def join_request(unique_id: bytes, rank: int, world_size: int, group_timeout: float):
    """A JoinWeightSyncGroupRequest; ValueError for what the server would refuse anyway."""
    unique_id = bytes(unique_id)
    if len(unique_id) != broadcast_plan.UNIQUE_ID_BYTES:
        raise ValueError(f"join_weight_sync_group: unique_id has {len(unique_id)} bytes; an "
                         "ncclUniqueId has 128 (the source's ncclGetUniqueId, unchanged)")
    rank = integer(rank, "join_weight_sync_group: rank")
    world_size = integer(world_size, "join_weight_sync_group: world_size")
    if not 0 <= rank < world_size:
        raise ValueError(f"join_weight_sync_group: rank {rank} is not in [0, {world_size})")
    return pb2.JoinWeightSyncGroupRequest(unique_id=unique_id, rank=rank,
                                          world_size=world_size,
                                          timeout_seconds=number(
                                              group_timeout,
                                              "join_weight_sync_group: group_timeout"))


def broadcast_tensor_specs(tensors: Sequence[Any]) -> List[broadcast_plan.TensorSpec]:
    """TensorSpec values of broadcast_plan.TensorSpec or (name, dtype, shape) tuples."""
    specs = []
    for t in tensors:
        if not isinstance(t, broadcast_plan.TensorSpec):
            name, dtype, shape = t
            t = broadcast_plan.TensorSpec(str(name), str(dtype), tuple(int(d) for d in shape))
        t.nbytes  # ValueError for an unknown dtype, naming the tensor
        specs.append(t)
    return specs


def broadcast_request(tensors: Sequence[Any], version: str, policy_name: Optional[str],
                      bucket_bytes: int, source_rank: int, broadcast_timeout: float,
                      expected_weight_digest: Optional[str]):
    """An UpdateWeightsFromBroadcastRequest declaring `tensors` (TensorSpec or (name, dtype,
    shape)) in broadcast order."""
    if not version:
        raise ValueError("update_weights_from_broadcast: version must be non-empty")
    bucket_bytes = integer(bucket_bytes, "update_weights_from_broadcast: bucket_bytes", 64,
                           signed=True)
    if bucket_bytes <= 0 or bucket_bytes % broadcast_plan.ALIGNMENT:
        raise ValueError(f"update_weights_from_broadcast: bucket_bytes = {bucket_bytes!r}; it "
                         f"must be a positive multiple of {broadcast_plan.ALIGNMENT}")
    source_rank = integer(source_rank, "update_weights_from_broadcast: source_rank")
    if broadcast_timeout is not None:
        broadcast_timeout = number(broadcast_timeout,
                                   "update_weights_from_broadcast: broadcast_timeout")
    request = pb2.UpdateWeightsFromBroadcastRequest(
        version=str(version), policy=policy(policy_name), bucket_bytes=bucket_bytes,
        source_rank=source_rank, timeout_seconds=broadcast_timeout or 0.0,
        expected_weight_digest=expected_weight_digest or "")
    for t in broadcast_tensor_specs(tensors):
        request.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape))
    return request


def update_from_path_request(path: str, version: str, policy_name: Optional[str]):
    return pb2.UpdateWeightsFromPathRequest(path=str(path), version=str(version),
                                            policy=policy(policy_name))


def abort_request(request_ids: Union[None, str, Sequence[str]], all_: bool):
    if isinstance(request_ids, str):
        request_ids = [request_ids]
    return pb2.AbortRequest(request_ids=list(request_ids or ()), all=all_)


def abort_result(r) -> AbortResult:
    return AbortResult(r.aborted_rollouts, list(r.unknown_request_ids), r.aborted_score_calls)


def flush_result(r) -> FlushCacheResult:
    return FlushCacheResult(r.freed_blocks, r.detached_blocks)
