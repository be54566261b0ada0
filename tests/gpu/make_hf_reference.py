#!/usr/bin/env python3
"""Reference outputs of an independent implementation (Hugging Face transformers) for
tests/gpu/hf_test.cc.

Builds a small random model with transformers (hidden 256, 4 layers, 8/2 heads x 32, vocab
4096, context 4096), rounds its weights to bf16 and saves it with save_pretrained
(safetensors). Then, in fp32 on those same bf16-valued weights, writes for a few random
prompts: a 40-token greedy continuation (full forward per step, no KV cache) with the top-1 /
top-2 margin of each step, and the logits of every position of prompt + continuation. Also the
RoPE inverse frequencies and attention scaling the model's rotary embedding really uses.

Architectures (the second argument):
  qwen3   Qwen3ForCausalLM, plain RoPE (theta 1e6). The default.
  llama3  LlamaForCausalLM in the Llama 3.1 style: rope_scaling llama3 (factor 8, low 1,
          high 4, original_max_position_embeddings 1024), theta 500000.
  yarn    Qwen3ForCausalLM with Qwen's long-context recipe: rope_scaling yarn (factor 4,
          original_max_position_embeddings 1024), theta 1e6.
The config.json of the scaled ones is left exactly as transformers wrote it.

Usage: make_hf_reference.py OUT_DIR [qwen3|llama3|yarn]
  (writes OUT_DIR/model/, OUT_DIR/reference.json, OUT_DIR/logits_*.f32)
"""
import inspect
import json
import math
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

GREEDY_STEPS = 40
PROMPT_LENGTHS = [1, 7, 33, 100, 257, 511]

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
             eos_token_id=2, bos_token_id=1)


def make_config(cls, theta, scaling, **kwargs):
    """A config with RoPE base `theta` and rope_scaling `scaling` (None: plain RoPE)."""
    if scaling is not None and "rope_parameters" in inspect.signature(cls.__init__).parameters:
        return cls(rope_parameters=dict(scaling, rope_theta=theta), **kwargs)  # transformers 5
    return cls(rope_theta=theta, rope_scaling=scaling, **kwargs)  # transformers 4


def build(arch):
    """The model, and the rope_type its rotary embedding must report."""
    if arch == "qwen3":
        return Qwen3ForCausalLM(make_config(Qwen3Config, 1000000.0, None, rms_norm_eps=1e-6,
                                            **SHAPE)), "default"
    if arch == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        return LlamaForCausalLM(make_config(LlamaConfig, 500000.0, scaling, rms_norm_eps=1e-5,
                                            mlp_bias=False, **SHAPE)), "llama3"
    if arch == "yarn":
        # factor = max_position_embeddings / original, so every transformers version agrees.
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
        return Qwen3ForCausalLM(make_config(Qwen3Config, 1000000.0, scaling, rms_norm_eps=1e-6,
                                            **SHAPE)), "yarn"
    sys.exit(f"unknown architecture {arch!r} (qwen3, llama3 or yarn)")


def main():
    out = sys.argv[1]
    arch = sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")
    model, want_rope_type = build(arch)
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type != want_rope_type:
        sys.exit(f"transformers built rope_type {rope_type!r}, not {want_rope_type!r}")
    inv_freq = rotary.inv_freq.double()
    # The float32 frequencies transformers computes at init. `model.to(torch.bfloat16)` below
    # would round this buffer to bf16 too (it is a floating buffer), which no inference engine
    # does and transformers' own from_pretrained(dtype=bf16) does not either (the buffer is
    # built in float32): restore it before the reference forward.
    inv_freq32 = rotary.inv_freq.detach().float().clone()
    original_inv_freq32 = getattr(rotary, "original_inv_freq", None)
    if original_inv_freq32 is not None:
        original_inv_freq32 = original_inv_freq32.detach().float().clone()
    attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
    head_dim = SHAPE["head_dim"]
    # Plain RoPE: the base the model really uses, read back from its inverse frequencies
    # (inv_freq[i] = theta^(-2i/d)), whatever config field spelling this version uses.
    theta = float(round(float(inv_freq[1] ** (-head_dim / 2.0))))
    # Scaled like model/random_model.cc so the next-token distribution is peaked (the HF default
    # init, std 0.02, gives near-uniform logits where any rounding flips the argmax).
    h = SHAPE["hidden_size"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * (torch.rand_like(p) * 2 - 1))
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, 3.0 / math.sqrt(h))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    model = model.to(torch.bfloat16)
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir, safe_serialization=True)

    config_path = os.path.join(model_dir, "config.json")
    if arch == "qwen3":
        # transformers >= 5 may write the RoPE base under rope_parameters / rope_scaling with
        # rope_type "default"; this reference has always served the classic top-level
        # rope_theta (the engine reads both).
        with open(config_path) as f:
            config = json.load(f)
        for key in ("rope_parameters", "rope_scaling"):
            rp = config.get(key)
            if isinstance(rp, dict) and rp.get("rope_type", "default") == "default":
                config[key] = None
        config["rope_theta"] = theta
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    with open(config_path) as f:
        saved = json.load(f)

    model = model.float().cuda().eval()
    rotary = model.model.rotary_emb
    with torch.no_grad():
        rotary.inv_freq.copy_(inv_freq32.to(rotary.inv_freq.device))
        if original_inv_freq32 is not None and hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = original_inv_freq32.to(rotary.inv_freq.device)
    gen = torch.Generator().manual_seed(1)
    ref = {"arch": arch, "vocab": SHAPE["vocab_size"], "prompts": [], "greedy": [],
           "margins": [], "logits_files": [], "rope_type": rope_type,
           "inv_freq": [float(x) for x in inv_freq32.cpu()],
           "attention_scaling": attention_scaling,
           "transformers": transformers.__version__, "torch": torch.__version__}
    with torch.no_grad():
        for i, n in enumerate(PROMPT_LENGTHS):
            prompt = torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist()
            ids = list(prompt)
            margins = []
            for _ in range(GREEDY_STEPS):
                logits = model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0, -1]
                top = torch.topk(logits, 2)
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(int(torch.argmax(logits)))  # first maximum: lowest index on ties
            full = model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0]
            name = f"logits_{i}.f32"
            full.float().cpu().numpy().astype("<f4").tofile(os.path.join(out, name))
            ref["prompts"].append(prompt)
            ref["greedy"].append(ids[n:])
            ref["margins"].append(margins)
            ref["logits_files"].append(name)
            print(f"prompt {i}: {n} tokens, greedy {ids[n:n + 8]}..., min margin "
                  f"{min(margins):.4f}", flush=True)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f)
    rope_fields = {k: saved.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")}
    print(f"{arch}: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"rope_type {rope_type}, attention_scaling {attention_scaling:.6f}, "
          f"config {json.dumps(rope_fields)}")


if __name__ == "__main__":
    main()
