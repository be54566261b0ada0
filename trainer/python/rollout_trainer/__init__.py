"""rollout_trainer: the rollout server's kernels as torch ops, and trainer-side Qwen3 models whose
logprobs equal the server's Generate and Score bit for bit: Qwen3Model on the CPU backend's
kernels (Qwen3MoeModel for Qwen3-MoE, TpQwen3Model at trainer TP > 1), CudaQwen3Model on the
CUDA backend's (CudaQwen3MoeModel for Qwen3-MoE, CudaTpQwen3Model at trainer TP > 1;
docs/trainer.md)."""

from ._lib import kernels_version
from .contract import ContractError, check_contract
from .cuda_model import CudaQwen3Model
from .cuda_moe_model import CudaQwen3MoeModel
from .cuda_tp import CudaTpQwen3Model
from .model import Qwen3Model
from .moe_model import Qwen3MoeModel
from .tp import TpQwen3Model

__all__ = ["Qwen3Model", "Qwen3MoeModel", "TpQwen3Model", "CudaQwen3Model", "CudaQwen3MoeModel",
           "CudaTpQwen3Model",
           "ContractError", "check_contract", "kernels_version"]
