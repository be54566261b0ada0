"""Python client of the deterministic rollout service (rollout.v1 over gRPC).

Tokens in, tokens out: prompts are token ids, results are token ids and logprobs (no
tokenizer). RolloutClient blocks; rollout_client.aio.RolloutClient is the same for asyncio.
Install with pip (the gRPC modules are generated then, see rollout_client._proto); needs grpcio
and protobuf, and numpy for arrays.
"""

from .client import RolloutClient
from ._wire import DEFAULT_TIMEOUT
from .broadcast import BroadcastError, WeightBroadcaster
from .fleet import Fleet, FleetError
from .datatypes import (AbortResult, Completion, EngineCounters, EngineLimits, FlushCacheResult,
                        ModelInfo, NumericsContract, ReleasedMemory, ReleaseMemoryResult, ResumeMemoryResult,
                        RolloutError, ScoreResult, ServerInfo, TokenChunk, UpdateWeightsResult,
                        VersionSpan, WeightSyncGroup, WeightSyncGroupInfo)
from .ipc import IpcTensor
from .safetensors import read_safetensors, write_safetensors
from .weights import RawTensor, bf16_bits_to_f32, f32_to_bf16_bits


def sample_seed(seed: int, j: int) -> int:
    """The seed the server uses for sample j of a rollout with seed `seed` (docs/api.md)."""
    if j == 0:
        return seed & 0xFFFFFFFFFFFFFFFF
    return _splitmix64((seed + j * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: int) -> int:
    m = 0xFFFFFFFFFFFFFFFF
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


__all__ = [
    "RolloutClient", "Fleet", "FleetError", "RolloutError", "Completion", "TokenChunk", "VersionSpan", "ScoreResult",
    "AbortResult", "FlushCacheResult", "UpdateWeightsResult", "ServerInfo", "ModelInfo",
    "EngineLimits", "EngineCounters", "ReleasedMemory", "ReleaseMemoryResult",
    "ResumeMemoryResult", "RawTensor", "read_safetensors", "write_safetensors",
    "f32_to_bf16_bits", "bf16_bits_to_f32", "sample_seed", "IpcTensor", "WeightBroadcaster",
    "BroadcastError", "WeightSyncGroup", "WeightSyncGroupInfo", "NumericsContract",
    "DEFAULT_TIMEOUT",
]
