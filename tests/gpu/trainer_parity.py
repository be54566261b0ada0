"""Trainer-side parity on CUDA (docs/trainer.md, "CUDA"), on a GPU host with torch and NO grpcio:
a GRPO-shaped batch of rollouts from `rollout-server --backend cuda` (through `rollout-cli
--json`, whose floats print round-trip exact), Score of the same sequences, then the same
logprobs recomputed in torch by rollout_trainer.CudaQwen3Model, compared bit for bit; the
gradients against a float32 plain-torch model (--grad_check); and the time of one GRPO step's
forward + backward against plain torch (bf16 cuBLAS + SDPA) on the same batch.

Exits 1 on any differing bit (trainer vs Generate, trainer vs Score, Generate vs Score), on a
control that cannot fail (plain torch must differ from Generate), on a contract refusal, or on
gradients beyond tolerance. Run by tests/gpu/trainer_parity.sh; all sizes are flags.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "trainer", "python"))

from rollout_trainer import CudaQwen3Model, ContractError  # noqa: E402
from rollout_trainer import cuda_ops  # noqa: E402


def log(*a):
    print(*a, flush=True)


# --- the server, through rollout-cli ---

class Cli:
    def __init__(self, cli: str, server: str):
        self.cli, self.server = cli, server

    def run(self, *args) -> list:
        out = subprocess.run([self.cli, "--server", self.server, "--json", *args],
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"rollout-cli {' '.join(args[-1:])}: rc {out.returncode}: "
                               f"{out.stderr[-2000:]}")
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def f32(values) -> np.ndarray:
    # protobuf's JSON prints a float's shortest round-trip form ("-Infinity" quoted).
    return np.array([np.float32(float(v)) for v in values], dtype=np.float32)


def rollouts(cli: Cli, args, vocab: int):
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]

    def generate(i):
        lines = cli.run("--prompt", ",".join(map(str, prompts[i])), "--samples", str(args.samples),
                        "--seed", str(args.seed * 1000 + i), "--temperature", str(args.temperature),
                        "--max_new_tokens", str(args.new_tokens), "--ignore_eos",
                        "--request_id", f"parity-{i}", "generate")
        done = [l["completion"] for l in lines if "completion" in l]
        return [(prompts[i], [int(t) for t in c["token_ids"]], f32(c["logprobs"]))
                for c in sorted(done, key=lambda c: int(c.get("sample_index", 0)))]

    with futures.ThreadPoolExecutor(args.concurrency) as pool:
        samples = [s for group in pool.map(generate, range(args.prompts)) for s in group]
    return samples


def scores(cli: Cli, args, samples):
    def score(s):
        prompt, completion, _ = s
        lines = cli.run("--tokens", ",".join(map(str, prompt + completion)), "--start",
                        str(len(prompt)), "--temperature", str(args.temperature), "score")
        return f32(lines[-1]["results"][0]["logprobs"])

    with futures.ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(score, samples))


def start_server(args):
    logf = open(os.path.join(args.out, f"trainer_parity_server_{args.port}.log"), "w")
    cmd = [args.server_bin, "--backend", "cuda", "--model", args.model, "--port", str(args.port),
           "--metrics_port", "0", *args.server_args.split()]
    log("server:", " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    path = logf.name
    for _ in range(3000):
        if proc.poll() is not None:
            raise RuntimeError(f"rollout-server exited rc {proc.returncode}; see {path}")
        with open(path) as f:
            if "listening on port" in f.read():
                return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"rollout-server did not start in 600 s; see {path}")


# --- plain torch: the same function, other kernels (the control, the timing baseline, the
# --- float32 gradient reference) ---

class PlainQwen3:
    """Qwen3 in plain torch on `model`'s parameters (the same tensors, cast to `dtype` when it
    is not bf16): HF-style RMSNorm and RoPE, cuBLAS matmuls, SDPA."""

    def __init__(self, model: CudaQwen3Model, dtype=torch.bfloat16):
        self.m, self.dtype = model, dtype
        self.gqa = "enable_gqa" in torch.nn.functional.scaled_dot_product_attention.__doc__

    def w(self, key):
        p = self.m.params[key]
        return p if self.dtype == torch.bfloat16 else p.to(self.dtype)

    def rms(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.m.eps)
        return w * xf.to(x.dtype)

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def attention(self, q, k, v, pack):
        t, h, d = q.shape
        group = h // k.shape[1]
        out = q.new_empty(t, h, d)
        for n, idx in pack.groups:
            qs = q[idx].transpose(1, 2)
            ks, vs = k[idx].transpose(1, 2), v[idx].transpose(1, 2)
            if self.gqa:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.m.scale, enable_gqa=True)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1),
                    is_causal=True, scale=self.m.scale)
            out[idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, h, d)
        return out

    def logprobs(self, tokens, pack, temperature):
        m = self.m
        t, hd, nh, nkv = tokens.numel(), m.head_dim, m.heads, m.kv_heads
        cos_t, sin_t = m._rope_tables(pack.max_len)
        pos = pack.positions.long()
        cos = torch.cat([cos_t[pos], cos_t[pos]], -1)[:, None, :].to(self.dtype)
        sin = torch.cat([sin_t[pos], sin_t[pos]], -1)[:, None, :].to(self.dtype)
        x = self.w("model__embed_tokens__weight")[tokens]
        for i in range(m.num_layers):
            k_ = lambda s: f"model__layers__{i}__{s}".replace(".", "__")
            h = self.rms(x, self.w(k_("input_layernorm.weight")))
            qkv = h @ self.w(k_("self_attn.qkv.weight")).t()
            q = qkv[:, :nh * hd].reshape(t, nh, hd)
            k = qkv[:, nh * hd:(nh + nkv) * hd].reshape(t, nkv, hd)
            v = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd)
            q = self.rope(self.rms(q, self.w(k_("self_attn.q_norm.weight"))), cos, sin)
            k = self.rope(self.rms(k, self.w(k_("self_attn.k_norm.weight"))), cos, sin)
            a = self.attention(q, k, v, pack).reshape(t, nh * hd)
            x = x + a @ self.w(k_("self_attn.o_proj.weight")).t()
            h = self.rms(x, self.w(k_("post_attention_layernorm.weight")))
            gate, up = (h @ self.w(k_("mlp.gate_up.weight")).t()).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ self.w(k_("mlp.down_proj.weight")).t()
        h = self.rms(x, self.w("model__norm__weight"))
        head = "model__embed_tokens__weight" if m.tied else "lm_head__weight"
        logits = h @ self.w(head).t()
        t_ = temperature if temperature > 0 else 1.0
        lp = torch.log_softmax(logits.float() / t_, dim=-1)
        targets = torch.cat([tokens[1:], tokens.new_zeros(1)])
        rows = lp.gather(1, targets[:, None])[:, 0]
        prev = torch.cat([rows.new_zeros(1), rows[:-1]])
        return torch.where(pack.first, torch.zeros((), dtype=rows.dtype, device=rows.device), prev)


# --- the batch ---

def pack_batch(model, samples):
    seqs = [p + c for p, c, _ in samples]
    cu = np.cumsum([0] + [len(s) for s in seqs])
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=model.device)
    # Completion positions in packed order (the tokens Generate sampled and Score scored).
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for (p, c, _), start in zip(samples, cu[:-1]):
        mask[int(start) + len(p):int(start) + len(p) + len(c)] = True
    return tokens, torch.tensor(cu), mask.to(model.device)


def microbatches(samples, size):
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def compare(name, got: np.ndarray, want: np.ndarray):
    diff = got.view(np.uint32) != want.view(np.uint32)
    d = np.abs(got.astype(np.float64) - want.astype(np.float64))
    d = np.where(np.isfinite(d), d, np.inf if diff.any() else 0.0)
    log(f"{name}: {int(diff.sum())} of {diff.size} tokens differ, max |d| = "
        f"{float(d.max()) if diff.size else 0.0:.9g}")
    return int(diff.sum())


def grpo_loss(lp, mask, advantages):
    return -(lp * advantages * mask).sum() / mask.sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="rollout-make-model checkpoint directory")
    ap.add_argument("--bin", default=".gpu/bin", help="folder of rollout-server and rollout-cli")
    ap.add_argument("--port", type=int, default=50091)
    ap.add_argument("--server_args", default="", help="more rollout-server flags")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/rollout-gpu"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--new_tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32, help="rollout-cli calls at once")
    ap.add_argument("--microbatch", type=int, default=8, help="sequences per forward/backward")
    ap.add_argument("--grad_check", action="store_true",
                    help="gradients against a float32 plain-torch model (small models)")
    ap.add_argument("--grad_tol", type=float, default=0.05,
                    help="largest relative error |g - g32| / |g32| per parameter tensor")
    ap.add_argument("--time_steps", type=int, default=3, help="timed GRPO steps (0: no timing)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.server_bin = os.path.join(args.bin, "rollout-server")
    cli = Cli(os.path.join(args.bin, "rollout-cli"), f"127.0.0.1:{args.port}")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])

    # 1. Rollouts and scores from the cuda server, then the server goes (its GPU memory too).
    server = start_server(args)
    try:
        info = cli.run("info")[-1]
        numerics = info["numerics"]
        log("server numerics:", json.dumps(numerics, indent=1))
        t0 = time.time()
        samples = rollouts(cli, args, vocab)
        log(f"{len(samples)} rollouts of {args.prompt_len} + {args.new_tokens} tokens in "
            f"{time.time() - t0:.1f} s")
        t0 = time.time()
        scored = scores(cli, args, samples)
        log(f"scored in {time.time() - t0:.1f} s")
    finally:
        server.terminate()
        server.wait(timeout=60)

    failures = []
    gen_all = np.concatenate([s[2] for s in samples])
    score_all = np.concatenate(scored)
    if compare("Generate vs Score", gen_all, score_all):
        failures.append("Generate vs Score")

    # 2. The trainer's model from the server's contract (refused, naming the field, otherwise).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        model = CudaQwen3Model.from_pretrained(args.model, contract=numerics)
    except ContractError as e:
        log(f"contract refused: {e}")
        log("this library's facts:", cuda_ops.device_facts())
        return 1
    log("trainer library:", cuda_ops.device_facts())

    # 3. Parity: the trainer's logprobs of every completion token, bitwise.
    plain = PlainQwen3(model)
    mine, control = [], []
    with torch.no_grad():
        for mb in microbatches(samples, args.microbatch):
            tokens, cu, mask = pack_batch(model, mb)
            pack = model.packing(cu)
            lp = model.logprobs(tokens, cu, args.temperature, pack=pack)
            mine.append(lp[mask].cpu().numpy())
            control.append(plain.logprobs(tokens, pack, args.temperature)[mask].cpu().numpy())
    mine_all = np.concatenate(mine)
    if compare("trainer vs Generate", mine_all, gen_all):
        failures.append("trainer vs Generate")
    if compare("trainer vs Score", mine_all, score_all):
        failures.append("trainer vs Score")
    differing = compare("control: plain torch bf16 vs Generate", np.concatenate(control), gen_all)
    if differing == 0:
        failures.append("the control (plain torch) equals Generate: the comparison cannot fail")

    # 4. Gradients against float32 plain torch (same weights, widened).
    rng = torch.Generator().manual_seed(args.seed)
    adv = lambda t: (torch.randn(t, generator=rng)).to(model.device)
    if args.grad_check:
        mb = samples[:args.microbatch]
        tokens, cu, mask = pack_batch(model, mb)
        pack = model.packing(cu)
        a = adv(tokens.numel())
        model.zero_grad(set_to_none=True)
        grpo_loss(model.logprobs(tokens, cu, args.temperature, pack=pack), mask, a).backward()
        mine_g = {k: p.grad.float().clone() for k, p in model.params.items()}
        model.zero_grad(set_to_none=True)
        ref = PlainQwen3(model, torch.float32)
        masters = {k: p.detach().float().requires_grad_(True) for k, p in model.params.items()}
        ref.w = lambda key: masters[key]
        grpo_loss(ref.logprobs(tokens, pack, args.temperature), mask, a).backward()
        worst = (0.0, "")
        for k, p in masters.items():
            g32 = p.grad
            if g32 is None:
                continue
            err = ((mine_g[k] - g32).norm() / g32.norm().clamp_min(1e-30)).item()
            worst = max(worst, (err, k))
        log(f"gradients vs float32 plain torch: worst relative error {worst[0]:.3e} ({worst[1]}),"
            f" tolerance {args.grad_tol}")
        if not worst[0] < args.grad_tol:
            failures.append("gradients")
        del masters, ref, mine_g

    # 5. Time: one GRPO step (every micro-batch's forward + backward) vs plain torch.
    if args.time_steps > 0:
        batches = [pack_batch(model, mb) for mb in microbatches(samples, args.microbatch)]
        packs = [model.packing(cu) for _, cu, _ in batches]
        advs = [adv(tokens.numel()) for tokens, _, _ in batches]

        def step(fn):
            model.zero_grad(set_to_none=True)
            for (tokens, cu, mask), pack, a in zip(batches, packs, advs):
                grpo_loss(fn(tokens, cu, pack), mask, a).backward()

        ours = lambda tokens, cu, pack: model.logprobs(tokens, cu, args.temperature, pack=pack)
        theirs = lambda tokens, cu, pack: plain.logprobs(tokens, pack, args.temperature)
        times = {}
        for name, fn in (("rollout_trainer (server kernels)", ours),
                         ("plain torch bf16 + SDPA", theirs)):
            step(fn)  # warm-up (pins' ladder, caches, allocator)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(args.time_steps):
                step(fn)
            end.record()
            torch.cuda.synchronize()
            times[name] = begin.elapsed_time(end) / args.time_steps
            tokens_total = sum(int(t.numel()) for t, _, _ in batches)
            log(f"{name}: {times[name]:.1f} ms per GRPO step (forward + backward, "
                f"{tokens_total} tokens, micro-batches of {args.microbatch}), "
                f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
            torch.cuda.reset_peak_memory_stats()
        ratio = times["rollout_trainer (server kernels)"] / times["plain torch bf16 + SDPA"]
        log(f"ratio: {ratio:.3f}x plain torch (goal <= 1.15x)")

    if failures:
        log("FAILED:", "; ".join(failures))
        return 1
    log("PASSED: trainer logprobs == Generate == Score, bitwise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
