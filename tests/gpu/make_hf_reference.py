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
  qwen3moe  Qwen3MoeForCausalLM: the same attention, 8 experts of width 128, 2 per token,
          norm_topk_prob, layer 1 dense (mlp_only_layers), plain RoPE. The reference also holds
          the routing transformers chose at every position and MoE layer (the top-k expert ids
          by router probability, from the router's input and weight recomputed in fp32) and the
          gap between the k-th and the (k+1)-th probability (a near-tie where it is small).
          Besides model/ (what save_pretrained writes by default), model_fused/ holds the same
          weights in the layout the transformers version keeps its experts in memory
          (transformers 5: mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj
          [E, H, I]; absent when that is the per-expert layout already).
The config.json of the scaled ones is left exactly as transformers wrote it.

Usage: make_hf_reference.py OUT_DIR [qwen3|llama3|yarn|qwen3moe]
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
MOE = dict(num_experts=8, top_k=2, mlp_only_layers=[1])


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
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        return Qwen3MoeForCausalLM(make_config(
            Qwen3MoeConfig, 1000000.0, None, rms_norm_eps=1e-6, num_experts=MOE["num_experts"],
            num_experts_per_tok=MOE["top_k"], moe_intermediate_size=128, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=MOE["mlp_only_layers"],
            **SHAPE)), "default"
    sys.exit(f"unknown architecture {arch!r} (qwen3, llama3, yarn or qwen3moe)")


class RouterProbe:
    """Records each MoE layer's router input on every forward (a pre-hook on mlp.gate, whatever
    module class the version uses), and recomputes the routing from it in fp32."""

    def __init__(self, model):
        self.inputs = {}
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "weight") or gate.weight.dim() != 2:
                continue  # a dense layer: its mlp.gate_proj is no router
            self.layers.append((i, gate))
            gate.register_forward_pre_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, args):
            self.inputs[i] = args[0].detach()
        return hook

    def routing(self):
        """[rows][moe layer][k] expert ids and [rows][moe layer] gaps of the last forward."""
        ids, gaps = [], []
        for i, gate in self.layers:
            x = self.inputs[i].reshape(-1, gate.weight.shape[1]).float()
            p = torch.softmax(x @ gate.weight.float().t(), dim=-1)
            top = torch.topk(p, MOE["top_k"] + 1, dim=-1)
            ids.append(top.indices[:, :MOE["top_k"]])
            gaps.append(top.values[:, MOE["top_k"] - 1] - top.values[:, MOE["top_k"]])
        return (torch.stack(ids, 1).cpu().tolist(), torch.stack(gaps, 1).cpu().tolist())


def save_fused(model, model_dir, fused_dir):
    """The experts as this transformers version holds them (its state_dict), when that is not
    the per-expert layout save_pretrained wrote; returns the fused tensor names written."""
    from safetensors.torch import save_file
    state = model.state_dict()
    fused = [k for k in state if k.endswith("mlp.experts.gate_up_proj") or
             k.endswith("mlp.experts.down_proj")]
    if not fused:
        return []
    os.makedirs(fused_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight" or
               not model.config.tie_word_embeddings}, os.path.join(fused_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = f.read()
    with open(os.path.join(fused_dir, "config.json"), "w") as f:
        f.write(config)
    return fused


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
    if arch in ("qwen3", "qwen3moe"):
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
    fused = save_fused(model, model_dir, os.path.join(out, "model_fused")) if arch == "qwen3moe" \
        else []
    if arch == "qwen3moe":
        from safetensors import safe_open
        names = set()
        for file in os.listdir(model_dir):
            if file.endswith(".safetensors"):
                with safe_open(os.path.join(model_dir, file), "pt") as f:
                    names.update(f.keys())
        expert_names = sorted(n for n in names if ".mlp.experts." in n)
        print(f"save_pretrained wrote {len(expert_names)} expert tensors, e.g. "
              f"{expert_names[:2]}; in memory (model_fused/): {fused[:2] or 'per expert'}",
              flush=True)

    model = model.float().cuda().eval()
    rotary = model.model.rotary_emb
    with torch.no_grad():
        rotary.inv_freq.copy_(inv_freq32.to(rotary.inv_freq.device))
        if original_inv_freq32 is not None and hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = original_inv_freq32.to(rotary.inv_freq.device)
    probe = RouterProbe(model) if arch == "qwen3moe" else None
    gen = torch.Generator().manual_seed(1)
    ref = {"arch": arch, "vocab": SHAPE["vocab_size"], "prompts": [], "greedy": [],
           "margins": [], "logits_files": [], "rope_type": rope_type, "routing": [],
           "routing_gaps": [], "fused_model": bool(fused),
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
            if probe is not None:
                routing, gaps = probe.routing()
                ref["routing"].append(routing)
                ref["routing_gaps"].append(gaps)
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
