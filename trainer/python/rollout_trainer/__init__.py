"""rollout_trainer: the rollout server's CPU kernels as torch ops, and a trainer-side Qwen3 whose
logprobs equal the CPU server's Generate and Score bit for bit (docs/trainer.md)."""

from ._lib import kernels_version
from .contract import ContractError, check_contract
from .model import Qwen3Model

__all__ = ["Qwen3Model", "ContractError", "check_contract", "kernels_version"]
