"""Plain dataclasses returned by RolloutClient (no protobuf types leak out).

Token ids and logprobs are Python lists; `tokens_array()` / `logprobs_array()` give them as
numpy arrays (int32 ids; float32 logprobs, the server's bits exactly), importing numpy only
then.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Union

import grpc

if TYPE_CHECKING:  # numpy is optional: imported only when an array is asked for
    import numpy

# Per generated (or scored) position: the top-N (token_id, logprob) pairs, most likely first
# (ties: lower token id first).
TopLogprobs = List[Tuple[int, float]]

FINISH_REASONS = {0: "unspecified", 1: "stop", 2: "length", 3: "abort"}


def _numpy():
    try:
        import numpy
    except ImportError:
        raise ImportError("rollout_client: arrays need numpy (Debian: apt-get install "
                          "python3-numpy; pip: pip install numpy); token_ids and logprobs "
                          "are plain lists without it") from None
    return numpy


def tokens_array(token_ids: List[int], dtype: Any = None) -> "numpy.ndarray":
    np = _numpy()
    return np.array(token_ids, dtype=np.int32 if dtype is None else dtype)


def logprobs_array(logprobs: List[float]) -> "numpy.ndarray":
    # Python floats read from the wire's float32 convert back to float32 exactly.
    np = _numpy()
    return np.array(logprobs, dtype=np.float32)


class RolloutError(Exception):
    """A call failed. `code` is the gRPC status code name ("INVALID_ARGUMENT", "UNAVAILABLE",
    ...), `message` the server's message unchanged (it names the rollout, field and bound).
    Pickles (and copies) as itself with every attribute, subclasses' too: it can cross a
    process boundary (multiprocessing, a process pool)."""

    def __init__(self, code: str, message: str, grpc_code: Optional[grpc.StatusCode] = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.grpc_code = grpc_code

    def __reduce__(self):
        # BaseException's would call cls(*self.args), i.e. cls("CODE: message"): a TypeError
        # for this __init__ and a subclass's. Rebuilt without __init__: args and attributes.
        return _rebuild_error, (type(self), self.args), self.__dict__

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "RolloutError":
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        code = code or grpc.StatusCode.UNKNOWN
        return cls(code.name, details or "", code)


def _rebuild_error(cls, args):
    """An exception of `cls` with `args`, its __init__ not run (pickle then restores its
    __dict__): what RolloutError.__reduce__ names."""
    error = cls.__new__(cls)
    error.args = args
    return error


@dataclass
class VersionSpan:
    version: str
    first_token: int  # index into Completion.token_ids, inclusive
    last_token: int   # inclusive


@dataclass
class TokenChunk:
    """New tokens of one sample since its previous chunk (generate(stream=True) only)."""
    prompt_index: int
    sample_index: int
    token_ids: List[int]
    logprobs: List[float]
    top_logprobs: List[TopLogprobs] = field(default_factory=list)

    def tokens_array(self, dtype: Any = None) -> "numpy.ndarray":
        """token_ids as a numpy array (int32 unless `dtype`, e.g. numpy.int64 for torch)."""
        return tokens_array(self.token_ids, dtype)

    def logprobs_array(self) -> "numpy.ndarray":
        """logprobs as a float32 numpy array, bit for bit what the server sent."""
        return logprobs_array(self.logprobs)


@dataclass
class Completion:
    """Everything one sample generated. `logprobs[i]` is log_softmax(logits / T)[token_ids[i]]
    in fp32 (T = 1 when greedy), computed before top-k/top-p/min-p filtering."""
    prompt_index: int
    sample_index: int
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str               # "stop", "length" or "abort"
    weight_version: str
    version_spans: List[VersionSpan]
    sample_seed: int
    cached_prompt_tokens: int
    top_logprobs: List[TopLogprobs] = field(default_factory=list)
    request_id: str = ""
    weight_digest: str = ""          # "sha256:<hex>" of the weights named weight_version
    # generate(return_routing=True) on a MoE model: per token the experts of every MoE layer,
    # flattened [token][MoE layer][num_experts_per_tok] (docs/api.md, routing replay).
    routing: List[int] = field(default_factory=list)
    # finish_reason "abort": what ended the sample, e.g. "the model's logits for position 17
    # (generated token 2) are not finite (NaN or Inf) under weight version 'v2': ..."; else "".
    abort_cause: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def tokens_array(self, dtype: Any = None) -> "numpy.ndarray":
        """token_ids as a numpy array (int32 unless `dtype`, e.g. numpy.int64 for torch)."""
        return tokens_array(self.token_ids, dtype)

    def logprobs_array(self) -> "numpy.ndarray":
        """logprobs as a float32 numpy array, bit for bit what the server sent."""
        return logprobs_array(self.logprobs)


@dataclass
class ScoreResult:
    logprobs: List[float]            # one per token_ids[start:]
    top_logprobs: List[TopLogprobs]
    weight_version: str
    cached_tokens: int
    weight_digest: str = ""
    routing: List[int] = field(default_factory=list)  # score(return_routing=True): as Completion

    def logprobs_array(self) -> "numpy.ndarray":
        """logprobs as a float32 numpy array, bit for bit what the server sent."""
        return logprobs_array(self.logprobs)


@dataclass
class AbortResult:
    aborted_rollouts: int
    unknown_request_ids: List[str]
    # all=True only: the Score calls in flight, which end ABORTED.
    aborted_score_calls: int = 0


@dataclass
class FlushCacheResult:
    freed_blocks: int
    detached_blocks: int


@dataclass
class UpdateWeightsResult:
    version: str
    previous_version: str
    tensors_updated: int
    bytes_received: int
    aborted_samples: int
    receive_seconds: float
    swap_seconds: float
    weight_digest: str               # the served weights' digest after the update
    # The server's time split (docs/api.md, "Where an update's time goes"); 0 from older servers.
    digest_wait_seconds: float = 0.0    # after receive: hashing not done yet
    device_copy_seconds: float = 0.0    # in swap: the copy into the served weights
    engine_wait_seconds: float = 0.0    # in swap, before the copy: step in flight, DRAIN, ABORT
    staging_setup_seconds: float = 0.0  # in receive: allocating the staging (first update)
    part_count: int = 0                 # the streams it came in; 0 from older servers
    # Measured by the client: the call's wall time and bytes_received over it.
    seconds: float = 0.0
    bytes_per_second: float = 0.0


@dataclass
class ReleasedMemory:
    """What ReleaseMemory holds released (ServerInfo.memory_released), in bytes."""
    kv_cache_bytes: int
    weight_bytes: int
    weights: bool                    # the weights too: updates wait for resume_memory()


@dataclass
class ReleaseMemoryResult:
    was_released: bool               # released already (nothing more, or only the weights)
    kv_cache_bytes: int              # released by this call
    weight_bytes: int
    preempted_samples: int           # in flight: requeued, recomputed after resume (same bits)
    aborted_samples: int             # abort_in_flight=True: ended
    seconds: float


@dataclass
class ResumeMemoryResult:
    was_released: bool               # False: nothing was released (a no-op)
    kv_cache_bytes: int              # taken back by this call
    weight_bytes: int
    seconds: float


@dataclass
class WeightSyncGroup:
    """This server's rank in an NCCL weight-sync group (JoinWeightSyncGroup)."""
    rank: int
    world_size: int
    seconds: float = 0.0             # the join's wait for every rank
    nccl_version: int = 0            # the server's libnccl, e.g. 22703 for 2.27.3


@dataclass
class NumericsContract:
    """ServerInfo.numerics: what a forward needs to reproduce the server's bits (docs/api.md,
    "Numerics contract"); rollout_trainer checks it. Fields that do not apply are ""/0/[]."""
    backend: str
    architecture: str
    compute_dtype: str
    served_dtype: str
    tensor_parallel: int
    row_parallel_reduction: str
    kernels: str
    rope_type: str
    gpu_model: str
    cuda_runtime: str
    cublaslt_version: str
    gemm_algorithms: List[str]
    attention_split_size: int
    attention_tile: int
    compute_capability: str
    gemm_pin_m: int
    gemm_ladder: bool
    attention_kernel: str


@dataclass
class WeightSyncGroupInfo:
    """ServerInfo.weight_sync_group: the group a server is a member of."""
    rank: int
    world_size: int


@dataclass
class ModelInfo:
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    eos_token_ids: List[int]
    source: str
    tie_word_embeddings: bool = False  # lm_head is the embedding: no lm_head.weight is served
    num_experts: int = 0             # mixture of experts; 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: List[int] = field(default_factory=list)  # a routing's MoE layers
    routing_replay: bool = False     # return_routing / routings are served


@dataclass
class EngineLimits:
    max_running_samples: int
    max_batch_tokens: int
    kv_block_size: int
    attention_split_size: int
    tensor_parallel: int
    admission: str  # --admission: "estimate", "reserve" or "optimistic"


@dataclass
class EngineCounters:
    running_samples: int
    waiting_samples: int
    kv_blocks_free: int
    kv_blocks_total: int
    generated_tokens: int
    prefilled_tokens: int
    engine_steps: int
    preemptions: int
    kv_blocks_cached: int
    prompt_tokens: int
    cache_hit_tokens: int
    scored_tokens: int
    recomputed_tokens: int
    weight_updates: int
    nonfinite_logit_rows: int        # logits rows with a NaN or Inf since start (diverged weights)
    paused_samples: int              # of running_samples, paused for a reader that fell behind


@dataclass
class ServerInfo:
    model: ModelInfo
    weight_version: str
    backend: str
    limits: EngineLimits
    counters: EngineCounters
    server_version: str
    paused: bool
    weight_update_in_progress: bool
    auth_required_for_generate: bool
    weight_digest: str               # "sha256:<hex>" of the served weights; "" if unknown
    # Set while release_memory() holds the memory released; None otherwise.
    memory_released: Optional[ReleasedMemory] = None
    # Set while the server is a member of an NCCL weight-sync group (JoinWeightSyncGroup).
    weight_sync_group: Optional[WeightSyncGroupInfo] = None
    # The numerics contract; None from a server that predates it.
    numerics: Optional[NumericsContract] = None

    def to_dict(self) -> dict:
        return asdict(self)


def message_to_dataclass(cls, message):
    """Fills dataclass `cls` from a protobuf message by field name (nested dataclasses and
    repeated scalars included). Fields the message lacks get their type's zero value."""
    from dataclasses import fields, is_dataclass
    import typing

    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        t = hints[f.name]
        v = getattr(message, f.name, None)
        optional = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) is Union and len(optional) == 1 and is_dataclass(optional[0]):
            # Optional[Message]: None unless the message field is set.
            has = getattr(message, "HasField", None)
            values[f.name] = (message_to_dataclass(optional[0], v)
                              if has is not None and has(f.name) else None)
        elif is_dataclass(t):
            values[f.name] = message_to_dataclass(t, v)
        elif typing.get_origin(t) in (list, List):
            values[f.name] = list(v) if v is not None else []
        else:
            values[f.name] = v if v is not None else t()
    return cls(**values)
