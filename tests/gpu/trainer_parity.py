"""Trainer-side parity on CUDA (docs/trainer.md, "CUDA"), on a GPU host with torch and NO grpcio:
a GRPO-shaped batch of rollouts from `rollout-server --backend cuda` (through `rollout-cli
--json`, whose floats print round-trip exact), Score of the same sequences, then the same
logprobs recomputed in torch by rollout_trainer.CudaQwen3Model (CudaQwen3MoeModel for a
Qwen3MoeForCausalLM checkpoint), compared bit for bit; the gradients against a float32
plain-torch model (--grad_check); and the time of one GRPO step's forward + backward against
plain torch (bf16 cuBLAS + SDPA) on the same batch.

--trainer_tp "2 4" adds trainer-side tensor parallelism (rollout_trainer.CudaTpQwen3Model): for
each degree, that many spawned ranks (nccl, one GPU each, where the host has enough GPUs; else
gloo, every rank on this GPU, collectives through host memory) recompute the completions of the
first --trainer_tp_samples samples; every rank's logprobs must equal Generate's bit for bit, and
with --grad_check each rank's gradients of the first micro-batch's loss must be the slices of
TP 1's (relative error under --grad_tol). With --server_args "--tp 2" the server is a TP 2 one
(ranks as streams on one GPU): trainer TP k == rollout TP m.

A MoE checkpoint adds (routing replay, Generate(return_routing)): the routing the trainer
chooses against Generate's and against Score(start = 1, return_routing)'s for every row; the
trainer replaying Generate's routing against Generate's bits; a perturbed routing (each id + 1
mod experts) replayed by the trainer against Score with that routing, bitwise, and -- the
control -- against Generate, which it must differ from; the grouping the kernels write against
MoeGroup's definition.

Prints one "CHECK <name>: PASS|FAIL ..." line per check and a summary; exits 1 when any
fails, or on a contract refusal. Run by tests/gpu/trainer_parity.sh; all sizes are flags.

--dry_run runs the script's plumbing without a GPU (a cpu server; the trainer on the CPU over
trainer/python/tests/fake_cuda_lib.py, no contract, no timing): every check runs, and the
bitwise ones are expected to FAIL -- no bit of the stand-in is a kernel's.
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

from rollout_trainer import CudaQwen3Model, CudaQwen3MoeModel, ContractError  # noqa: E402
from rollout_trainer import CudaTpQwen3Model  # noqa: E402
from rollout_trainer import tp as tp_mod  # noqa: E402
from rollout_trainer import cuda_ops  # noqa: E402

MOE = "Qwen3MoeForCausalLM"


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
                        "--request_id", f"parity-{i}", *(["--return_routing"] if args.moe else []),
                        "generate")
        done = [l["completion"] for l in lines if "completion" in l]
        # (prompt, completion, logprobs, routing: Completion.routing, [] for a dense model)
        return [(prompts[i], [int(t) for t in c["token_ids"]], f32(c["logprobs"]),
                 [int(x) for x in c.get("routing", [])])
                for c in sorted(done, key=lambda c: int(c.get("sample_index", 0)))]

    with futures.ThreadPoolExecutor(args.concurrency) as pool:
        samples = [s for group in pool.map(generate, range(args.prompts)) for s in group]
    return samples


def scores(cli: Cli, args, samples, routings=None):
    """Score of each sample's completion: its logprobs (with routings[i] replayed when given)."""
    def score(i):
        prompt, completion = samples[i][0], samples[i][1]
        replay = [] if routings is None else ["--routing", ",".join(map(str, routings[i]))]
        lines = cli.run("--tokens", ",".join(map(str, prompt + completion)), "--start",
                        str(len(prompt)), "--temperature", str(args.temperature), *replay, "score")
        return f32(lines[-1]["results"][0]["logprobs"])

    with futures.ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(score, range(len(samples))))


def every_row_routing(cli: Cli, args, samples):
    """Score(start = 1, return_routing)'s routing of each sample: the experts of every row that
    produced a logprob (tokens 1 .. len - 1 of prompt + completion), flattened."""
    def score(s):
        tokens = s[0] + s[1]
        lines = cli.run("--tokens", ",".join(map(str, tokens)), "--start", "1", "--temperature",
                        str(args.temperature), "--return_routing", "score")
        return [int(x) for x in lines[-1]["results"][0].get("routing", [])]

    with futures.ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(score, samples))


def start_server(args):
    logf = open(os.path.join(args.out, f"trainer_parity_server_{args.port}.log"), "w")
    backend = "cpu" if args.dry_run else "cuda"
    cmd = [args.server_bin, "--backend", backend, "--model", args.model, "--port", str(args.port),
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
    is not bf16): HF-style RMSNorm and RoPE, cuBLAS matmuls, SDPA; a CudaQwen3MoeModel's MoE
    layers as transformers' Qwen3MoeSparseMoeBlock computes them (fp32 router softmax, each
    expert's SwiGLU on its rows, weighted sum)."""

    def __init__(self, model: CudaQwen3Model, dtype=torch.bfloat16):
        self.m, self.dtype = model, dtype
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        self.gqa = sdpa is not None and "enable_gqa" in sdpa.__doc__
        self.sdpa = sdpa is not None  # torch < 2.0 (--dry_run on the CPU): the reference

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
        if not self.sdpa:
            from rollout_trainer import ops as cpu_ops
            return cpu_ops.reference_attention(q, k, v, torch.tensor(pack.cu), self.m.scale)
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

    def moe(self, i, h, ids=None):
        """MoE layer i of normed h [t, hidden]: the router's softmax in fp32 at ids [t, k] (a
        given routing: the same piece of the function as the trainer's) or at torch.topk's,
        renormalised with norm_topk_prob; each expert's SwiGLU on its rows, weighted, summed."""
        m = self.m
        k_ = lambda s: f"model__layers__{i}__{s}".replace(".", "__")
        p = torch.softmax((h @ self.w(k_("mlp.gate.weight")).t()).float(), dim=-1)
        ids = torch.topk(p, m.top_k, dim=-1).indices if ids is None else ids.long()
        w = p.gather(1, ids)
        if m.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        gate_up, down = self.w(k_("mlp.experts.gate_up_proj")), self.w(k_("mlp.experts.down_proj"))
        out = torch.zeros_like(h)
        for e in range(m.num_experts):
            tok, rank = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = (h[tok] @ gate_up[e].t()).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ down[e].t()
            out = out.index_add(0, tok, y * w[tok, rank, None].to(y.dtype))
        return out

    def logprobs(self, tokens, pack, temperature, row_routing=None):
        """row_routing: int [t, moe layers, k], the experts of each row (not entry-aligned);
        rows where it is negative choose by torch.topk."""
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
            if i in getattr(m, "_moe_index", {}):
                ids = None
                if row_routing is not None:
                    given = row_routing[:, m._moe_index[i]]
                    chosen = torch.topk(torch.softmax(
                        (h @ self.w(k_("mlp.gate.weight")).t()).float(), -1), m.top_k, -1).indices
                    ids = torch.where(given >= 0, given.long(), chosen)
                x = x + self.moe(i, h, ids)
                continue
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
    seqs = [s[0] + s[1] for s in samples]
    cu = np.cumsum([0] + [len(s) for s in seqs])
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=model.device)
    # Completion positions in packed order (the tokens Generate sampled and Score scored).
    mask = torch.zeros(int(cu[-1]), dtype=torch.bool)
    for s, start in zip(samples, cu[:-1]):
        p, c = s[0], s[1]
        mask[int(start) + len(p):int(start) + len(p) + len(c)] = True
    return tokens, torch.tensor(cu), mask.to(model.device)


def microbatches(samples, size):
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def compare(name, got: np.ndarray, want: np.ndarray) -> int:
    """Entries of got and want whose bits differ (logprobs fp32, or routing ids), logged."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        log(f"{name}: {got.size} entries against {want.size}: the shapes differ")
        return max(got.size, want.size, 1)
    if got.dtype == np.float32:
        diff = got.view(np.uint32) != want.view(np.uint32)
        d = np.abs(got.astype(np.float64) - want.astype(np.float64))
        d = np.where(np.isfinite(d), d, np.inf if diff.any() else 0.0)
        log(f"{name}: {int(diff.sum())} of {diff.size} differ, max |d| = "
            f"{float(d.max()) if diff.size else 0.0:.9g}")
    else:
        diff = got != want
        log(f"{name}: {int(diff.sum())} of {diff.size} differ")
    return int(diff.sum())


def grpo_loss(lp, mask, advantages):
    return -(lp * advantages * mask).sum() / mask.sum()


class Checks:
    """One "CHECK name: PASS|FAIL detail" line per check; the summary at the end."""

    def __init__(self):
        self.results = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, bool(ok)))
        log(f"CHECK {name}: {'PASS' if ok else 'FAIL'}{' (' + detail + ')' if detail else ''}")
        return bool(ok)

    def failed(self):
        return [n for n, ok in self.results if not ok]


def completion_mask_rows(cu, samples):
    """(sequence start, prompt length, end) of each packed sample."""
    return [(int(b), len(s[0]), int(e)) for s, b, e in zip(samples, cu[:-1], cu[1:])]


def moe_server_side(cli, args, samples):
    """What the MoE checks need from the server, asked before it goes (the trainer needs its
    GPU memory): Score(start = 1, return_routing)'s routing of every row, and Score of the first
    micro-batch replaying a perturbed routing (each id of Generate's + 1 mod experts)."""
    with open(os.path.join(args.model, "config.json")) as f:
        experts = int(json.load(f)["num_experts"])
    mb = samples[:args.microbatch]
    perturbed = [[(x + 1) % experts for x in s[3]] for s in mb]
    return {"every_row": every_row_routing(cli, args, mb), "perturbed": perturbed,
            "perturbed_scores": np.concatenate(scores(cli, args, mb, routings=perturbed))}


def moe_checks(check, args, model, samples, server):
    """Routing replay (module docstring), on the first micro-batch; `server`: moe_server_side's."""
    mb = samples[:args.microbatch]
    tokens, cu, mask = pack_batch(model, mb)
    pack = model.packing(cu)
    rows = completion_mask_rows(cu, mb)
    gen = np.concatenate([s[2] for s in mb])
    e = model.num_experts
    with torch.no_grad():
        # The routing the trainer chooses: Generate's, and every row's as Score reports it.
        lp, used = model.logprobs(tokens, cu, args.temperature, pack=pack, return_routing=True)
        mine = np.concatenate([used[b + p:end].reshape(-1).numpy() for b, p, end in rows])
        theirs = np.array([x for s in mb for x in s[3]], dtype=np.int32)
        n = compare("trainer's routing vs Generate's (completion tokens)", mine, theirs)
        check("moe: trainer chooses Generate's routing", n == 0 and theirs.size > 0,
              f"{n} of {theirs.size} expert ids differ")
        mine = np.concatenate([used[b + 1:end].reshape(-1).numpy() for b, _, end in rows])
        theirs = np.array([x for r in server["every_row"] for x in r], dtype=np.int32)
        n = compare("trainer's routing vs Score(start=1)'s (every row)", mine, theirs)
        check("moe: every row's routing is Score's", n == 0 and theirs.size > 0,
              f"{n} of {theirs.size} expert ids differ")

        # Generate's routing replayed: Generate's bits.
        routing, replay = model.pack_routing([s[3] for s in mb], [len(s[0]) for s in mb], cu)
        lp_r = model.logprobs(tokens, cu, args.temperature, pack=pack, routing=routing,
                              replay=replay)
        n = compare("trainer replaying Generate's routing vs Generate", lp_r[mask].cpu().numpy(),
                    gen)
        check("moe: replayed routing gives Generate's bits", n == 0,
              f"{n} of {gen.size} logprobs differ")

        # Another routing replayed: Score-with-it's bits, and not Generate's (the control).
        perturbed, want = server["perturbed"], server["perturbed_scores"]
        routing, replay = model.pack_routing(perturbed, [len(s[0]) for s in mb], cu)
        lp_p, used_p = model.logprobs(tokens, cu, args.temperature, pack=pack, routing=routing,
                                      replay=replay, return_routing=True)
        n = compare("trainer vs Score, both replaying a perturbed routing",
                    lp_p[mask].cpu().numpy(), want)
        check("moe: perturbed routing replayed == Score with it", n == 0,
              f"{n} of {want.size} logprobs differ")
        taken = np.concatenate([used_p[b + p:end].reshape(-1).numpy() for b, p, end in rows])
        n = compare("routing the trainer used vs the perturbed routing", taken,
                    np.array([x for r in perturbed for x in r], dtype=np.int32))
        check("moe: the trainer used the replayed routing", n == 0, f"{n} expert ids differ")
        n = compare("control: perturbed-routing logprobs vs Generate", want, gen)
        check("moe: control (perturbed routing differs from Generate)", n > 0,
              f"{n} of {gen.size} logprobs differ")

        # The routing and grouping the kernels write are MoeRoute's and MoeGroup's definitions
        # (the backward reads the grouping).
        g = torch.Generator().manual_seed(7)
        t, k, h = 333, model.top_k, model.hidden
        logits = torch.randn(t, e, generator=g).to(model.device)
        ids, _ = cuda_ops.MoeRoute.apply(logits, None, None, k, model.norm_topk_prob)
        xn = (torch.randn(t, h, generator=g) * 0.5).to(model.device, torch.bfloat16)
        layer = model.moe_layers[0]
        w_gu = model.params[f"model__layers__{layer}__mlp__experts__gate_up_proj"]
        w_d = model.params[f"model__layers__{layer}__mlp__experts__down_proj"]
        y, slots = cuda_ops.MoeExperts.apply(xn, ids, w_gu, w_d)
        grouped_rows, want_slots, offsets = cuda_ops.group_assignments(ids, e)
        top = torch.topk(logits, k, dim=-1).indices
        ok = torch.equal(slots.long(), want_slots) and torch.equal(ids.long(), top)
        # Each grouped row: its expert's SwiGLU of its token (fp32 torch, loosely: bf16 inside).
        worst = 0.0
        for ex in range(e):
            b, end = int(offsets[ex]), int(offsets[ex + 1])
            if b == end:
                continue
            gate, up = (xn[grouped_rows[b:end]].float() @ w_gu[ex].float().t()).chunk(2, -1)
            ref = (torch.nn.functional.silu(gate) * up) @ w_d[ex].float().t()
            worst = max(worst, ((y[b:end] - ref).norm() / ref.norm()).item())
        check("moe: kernels' routing and grouping are MoeRoute's and MoeGroup's definitions",
              ok and worst < 2e-2, f"ids and slots equal: {ok}, expert outputs vs fp32 torch: "
                                   f"relative error {worst:.2e}")


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
    ap.add_argument("--trainer_tp", default="",
                    help="trainer TP degrees to check against Generate, e.g. \"2 4\"")
    ap.add_argument("--trainer_tp_samples", type=int, default=0,
                    help="samples the TP ranks recompute (0: all)")
    ap.add_argument("--dry_run", action="store_true",
                    help="the plumbing without a GPU (module docstring); bitwise checks FAIL")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.server_bin = os.path.join(args.bin, "rollout-server")
    cli = Cli(os.path.join(args.bin, "rollout-cli"), f"127.0.0.1:{args.port}")
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    vocab = int(config["vocab_size"])
    args.moe = (config.get("architectures") or [""])[0] == MOE
    check = Checks()

    # 1. Rollouts and scores from the cuda server (and what the MoE checks need of it), then
    # the server goes (its GPU memory too).
    moe_server = None
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

        if args.moe:
            t0 = time.time()
            moe_server = moe_server_side(cli, args, samples)
            log(f"routing Scores in {time.time() - t0:.1f} s")
    finally:
        server.terminate()
        server.wait(timeout=60)

    gen_all = np.concatenate([s[2] for s in samples])
    score_all = np.concatenate(scored)
    n = compare("Generate vs Score", gen_all, score_all)
    check("Generate == Score", n == 0, f"{n} of {gen_all.size} logprobs differ")

    # 2. The trainer's model from the server's contract (refused, naming the field, otherwise).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cls = CudaQwen3MoeModel if args.moe else CudaQwen3Model
    if args.dry_run:
        return dry_run(args, cls, lambda model: check_model(args, check, model, samples,
                                                            moe_server, gen_all, score_all))
    try:
        model = cls.from_pretrained(args.model, contract=numerics)
    except ContractError as e:
        log(f"contract refused: {e}")
        log("this library's facts:", cuda_ops.device_facts())
        check("contract honoured", False, str(e))
        return 1
    log("trainer library:", cuda_ops.device_facts())
    args.numerics = numerics
    return check_model(args, check, model, samples, moe_server, gen_all, score_all)


def check_model(args, check, model, samples, moe_server, gen_all, score_all) -> int:
    """The trainer's checks (main's steps 3 to 5, and the MoE checks) on its model."""
    if args.moe:
        try:
            moe_checks(check, args, model, samples, moe_server)
        except Exception as e:  # noqa: BLE001 -- reported as a failed check; the rest runs
            log(f"MoE checks raised {type(e).__name__}: {e}")
            check("moe: checks ran", False, f"{type(e).__name__}: {e}")

    # 3. Parity: the trainer's logprobs of every completion token, bitwise.
    plain = PlainQwen3(model)
    mine, control = [], []
    with torch.no_grad():
        for mb in microbatches(samples, args.microbatch):
            tokens, cu, mask = pack_batch(model, mb)
            pack = model.packing(cu)
            lp, row_routing = trainer_logprobs(args, model, tokens, cu, pack)
            mine.append(lp[mask].cpu().numpy())
            control.append(plain.logprobs(tokens, pack, args.temperature, row_routing)[mask]
                           .cpu().numpy())
    mine_all = np.concatenate(mine)
    n = compare("trainer vs Generate", mine_all, gen_all)
    check("trainer == Generate", n == 0, f"{n} of {gen_all.size} logprobs differ")
    n = compare("trainer vs Score", mine_all, score_all)
    check("trainer == Score", n == 0, f"{n} of {score_all.size} logprobs differ")
    differing = compare("control: plain torch bf16 vs Generate", np.concatenate(control), gen_all)
    check("control (plain torch bf16 differs from Generate)", differing > 0,
          f"{differing} of {gen_all.size} logprobs differ")

    # 4. Gradients against float32 plain torch (same weights, widened; a MoE model's routing
    # replayed, so that both are the same piece of the function).
    rng = torch.Generator().manual_seed(args.seed)
    adv = lambda t: (torch.randn(t, generator=rng)).to(model.device)
    if args.grad_check:
        mb = samples[:args.microbatch]
        tokens, cu, mask = pack_batch(model, mb)
        pack = model.packing(cu)
        a = adv(tokens.numel())
        model.zero_grad(set_to_none=True)
        lp, row_routing = trainer_logprobs(args, model, tokens, cu, pack)
        grpo_loss(lp, mask, a).backward()
        mine_g = {k: p.grad.float().clone() for k, p in model.params.items()
                  if p.grad is not None}
        model.zero_grad(set_to_none=True)
        ref = PlainQwen3(model, torch.float32)
        masters = {k: p.detach().float().requires_grad_(True) for k, p in model.params.items()}
        ref.w = lambda key: masters[key]
        grpo_loss(ref.logprobs(tokens, pack, args.temperature, row_routing), mask, a).backward()
        worst, missing = (0.0, ""), []
        for k, p in masters.items():
            g32 = p.grad
            if g32 is None:
                continue
            if k not in mine_g:
                missing.append(k)
                continue
            if args.moe and "experts" in k:
                # Per expert: an expert's gradient is its own tensor in the server's names.
                for e in range(g32.shape[0]):
                    n32 = g32[e].norm()
                    if n32 == 0:
                        ok0 = mine_g[k][e].abs().max().item() == 0
                        worst = max(worst, (0.0 if ok0 else float("inf"), f"{k}[{e}]"))
                        continue
                    err = ((mine_g[k][e] - g32[e]).norm() / n32).item()
                    worst = max(worst, (err, f"{k}[{e}]"))
                continue
            err = ((mine_g[k] - g32).norm() / g32.norm().clamp_min(1e-30)).item()
            worst = max(worst, (err, k))
        log(f"gradients vs float32 plain torch: worst relative error {worst[0]:.3e} ({worst[1]}),"
            f" tolerance {args.grad_tol}")
        check("gradients vs float32 plain torch", worst[0] < args.grad_tol and not missing,
              f"worst relative error {worst[0]:.3e} at {worst[1]}, tolerance {args.grad_tol}"
              + (f"; no gradient for {missing}" if missing else ""))
        del masters, ref, mine_g

    # 4b. Trainer-side TP: every rank's logprobs are Generate's (and its gradients TP 1's slices).
    if args.trainer_tp and not args.moe and not args.dry_run:
        try:
            tp_checks(check, args, model, samples, gen_all)
        except Exception as e:  # noqa: BLE001 -- reported as a failed check; the rest runs
            log(f"trainer TP checks raised {type(e).__name__}: {e}")
            check("trainer TP: checks ran", False, f"{type(e).__name__}: {e}")

    # 5. Time: one GRPO step (every micro-batch's forward + backward) vs plain torch.
    if args.time_steps > 0:
        try:
            time_steps(args, model, plain, samples, adv)
        except Exception as e:  # noqa: BLE001 -- the checks above stand; report and go on
            log(f"timing raised {type(e).__name__}: {e}")
            check("timing ran", False, f"{type(e).__name__}: {e}")

    failures = check.failed()
    log(f"SUMMARY: {len(check.results) - len(failures)} of {len(check.results)} checks passed"
        f" ({os.path.basename(os.path.normpath(args.model))})")
    if failures:
        log("FAILED:", "; ".join(failures))
        return 1
    log("PASSED: trainer logprobs == Generate == Score, bitwise"
        + (", routing replay included" if args.moe else ""))
    return 0


def _tp_rank_main(rank, tp, port, args, batches, advantages, queue):
    """One trainer TP rank: the logprobs of `batches` ([(tokens, cu, mask)] numpy) and, with
    advantages, the gradients of the first batch's GRPO loss, into `queue` as numpy."""
    try:
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", rank if gpus >= tp else 0)
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= tp else "gloo"
        import torch.distributed as dist
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp)
        model = CudaTpQwen3Model.from_pretrained(args.model, contract=args.numerics,
                                                 tp_group=dist.group.WORLD, device=device)
        out = {"backend": backend, "lp": []}
        with torch.no_grad():
            for tokens, cu, mask in batches:
                t = torch.from_numpy(tokens).to(device)
                lp = model.logprobs(t, cu, args.temperature)
                out["lp"].append(lp[torch.from_numpy(mask).to(device)].cpu().numpy())
        if advantages is not None:
            tokens, cu, mask = batches[0]
            model.zero_grad(set_to_none=True)
            lp = model.logprobs(torch.from_numpy(tokens).to(device), cu, args.temperature)
            grpo_loss(lp, torch.from_numpy(mask).to(device),
                      torch.from_numpy(advantages).to(device)).backward()
            out["grads"] = {}
            for name, (key, rows) in model._names.items():
                g = model.params[key].grad
                if g is not None:
                    out["grads"][name] = (g if rows is None else g[rows]).float().cpu().numpy()
        queue.put((rank, out))
        dist.destroy_process_group()
    except BaseException:  # noqa: B902 -- reported to the parent
        import traceback
        queue.put((rank, traceback.format_exc()))


def tp_checks(check, args, model, samples, gen_all):
    """Trainer TP at each degree of args.trainer_tp: spawned ranks' logprobs against Generate's,
    bitwise; their gradients against TP 1's slices (--grad_check)."""
    import socket
    import torch.multiprocessing as mp
    n = args.trainer_tp_samples or len(samples)
    subset = samples[:n]
    want = np.concatenate([s[2] for s in subset])
    batches = []
    for mb in microbatches(subset, args.microbatch):
        tokens, cu, mask = pack_batch(model, mb)
        batches.append((tokens.cpu().numpy(), cu.numpy(), mask.cpu().numpy()))
    adv = tp1_grads = None
    if args.grad_check:
        tokens, cu, mask = batches[0]
        adv = torch.randn(tokens.size, generator=torch.Generator().manual_seed(7)).numpy()
        model.zero_grad(set_to_none=True)
        dev = model.device
        lp = model.logprobs(torch.from_numpy(tokens).to(dev), cu, args.temperature)
        grpo_loss(lp, torch.from_numpy(mask).to(dev), torch.from_numpy(adv).to(dev)).backward()
        tp1_grads = {name: (model.params[key].grad if rows is None else
                            model.params[key].grad[rows]).float().cpu()
                     for name, (key, rows) in model._names.items()
                     if model.params[key].grad is not None}
        model.zero_grad(set_to_none=True)
    for tp in [int(v) for v in args.trainer_tp.replace(",", " ").split()]:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        t0 = time.time()
        procs = [ctx.Process(target=_tp_rank_main,
                             args=(r, tp, port, args, batches, adv, queue)) for r in range(tp)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(tp):
                rank, out = queue.get(timeout=1800)
                results[rank] = out
        finally:
            for p in procs:
                p.join(timeout=120)
                if p.is_alive():
                    p.kill()
        errors = [f"rank {r}: {o}" for r, o in results.items() if isinstance(o, str)]
        if errors:
            log("\n".join(errors))
            check(f"trainer TP {tp}: ranks ran", False, errors[0].splitlines()[-1])
            continue
        log(f"trainer TP {tp} ({results[0]['backend']}): {n} samples in {time.time() - t0:.1f} s")
        apart = [compare(f"trainer TP {tp} rank {r} vs Generate", np.concatenate(o["lp"]), want)
                 for r, o in sorted(results.items())]
        check(f"trainer TP {tp} == Generate (every rank)", max(apart) == 0,
              f"{max(apart)} of {want.size} logprobs differ on the worst rank")
        if tp1_grads is None:
            continue
        worst = (0.0, "")
        for r, o in sorted(results.items()):
            shard = tp_mod.shard_of(model.config, tp, r)
            for name, g in o["grads"].items():
                ref = tp1_grads[name][tp_mod.shard_index(name, shard, model.config) or ()]
                err = ((torch.from_numpy(g) - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                worst = max(worst, (err, f"rank {r} {name}"))
        log(f"trainer TP {tp} gradients vs TP 1's slices: worst relative error {worst[0]:.3e} "
            f"({worst[1]})")
        check(f"trainer TP {tp} gradients == TP 1's slices", worst[0] < args.grad_tol,
              f"worst relative error {worst[0]:.3e} at {worst[1]}, tolerance {args.grad_tol}")


def dry_run(args, cls, run) -> int:
    """run(model) with the trainer on the CPU over the CUDA library's stand-in."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "trainer", "python", "tests"))
    import fake_cuda_lib  # noqa: E402
    from rollout_trainer.model import _read_safetensors  # noqa: E402
    args.time_steps = 0
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    with fake_cuda_lib.installed():
        return run(cls(config, _read_safetensors(args.model), device="cpu"))


def trainer_logprobs(args, model, tokens, cu, pack):
    """The trainer's logprobs of a packed batch at args.temperature, and (a MoE model) the
    experts each row chose, row-aligned for plain torch to replay; None for a dense model."""
    if not args.moe:
        return model.logprobs(tokens, cu, args.temperature, pack=pack), None
    lp, used = model.logprobs(tokens, cu, args.temperature, pack=pack, return_routing=True)
    return lp, row_aligned(used, cu, model.device)


def row_aligned(used, cu, device):
    """The experts of each row [t, moe layers, k] from an entry-aligned routing (entry i = row
    i - 1's); -1 on each sequence's last row, which produces no logprob (plain torch chooses
    there: it changes nothing the loss sees)."""
    rows = torch.full_like(used, -1)
    rows[:-1] = used[1:]
    last = torch.as_tensor(cu[1:]).long() - 1
    rows[last] = -1
    return rows.to(device)


def time_steps(args, model, plain, samples, adv):
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


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # noqa: BLE001 -- one clear line for the log's reader, then the trace
        log("SUMMARY: FAILED: the script raised before its checks finished")
        raise
