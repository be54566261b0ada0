#!/usr/bin/env python3
"""Reference outputs of an independent implementation (Hugging Face transformers) for
tests/gpu/hf_test.cc.

Builds a small random Qwen3 (hidden 256, 4 layers, 8/2 heads x 32, vocab 4096), rounds its
weights to bf16 and saves it with save_pretrained (safetensors). Then, in fp32 on those same
bf16-valued weights, writes for a few random prompts: a 40-token greedy continuation (full
forward per step, no KV cache) with the top-1 / top-2 margin of each step, and the logits of every
position of prompt + continuation.

Usage: make_hf_reference.py OUT_DIR   (writes OUT_DIR/model/, OUT_DIR/reference.json, *.f32)
"""
import json
import math
import os
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

GREEDY_STEPS = 40
PROMPT_LENGTHS = [1, 7, 33, 100, 257, 511]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("highest")
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                      eos_token_id=2, bos_token_id=1)
    model = Qwen3ForCausalLM(cfg)
    # The RoPE base the model really uses, read back from its inverse frequencies
    # (inv_freq[i] = theta^(-2i/d)), whatever config field spelling this version uses.
    inv_freq = model.model.rotary_emb.inv_freq.double()
    theta = float(inv_freq[1] ** (-cfg.head_dim / 2.0))
    theta = float(round(theta))
    # Scaled like model/random_model.cc so the next-token distribution is peaked (the HF default
    # init, std 0.02, gives near-uniform logits where any rounding flips the argmax).
    h = cfg.hidden_size
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

    # transformers >= 5 may write the RoPE base under rope_parameters / rope_scaling with
    # rope_type "default"; the engine reads the classic top-level rope_theta.
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for key in ("rope_parameters", "rope_scaling"):
        rp = config.get(key)
        if isinstance(rp, dict) and rp.get("rope_type", "default") == "default":
            config[key] = None
    config["rope_theta"] = theta
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)

    model = model.float().cuda().eval()
    gen = torch.Generator().manual_seed(1)
    ref = {"vocab": cfg.vocab_size, "prompts": [], "greedy": [], "margins": [], "logits_files": []}
    with torch.no_grad():
        for i, n in enumerate(PROMPT_LENGTHS):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
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
    print("transformers", __import__("transformers").__version__, "torch", torch.__version__,
          "rope_theta", theta)


if __name__ == "__main__":
    main()
