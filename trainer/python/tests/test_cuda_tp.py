"""CudaTpQwen3Model's wiring on the CPU (rollout_trainer.cuda_tp), over the plain-torch stand-in
for the CUDA library (tests/fake_cuda_lib.py, bf16 standing for float64): ranks of a gloo group
at TP 2 and 4 (spawned processes; TP 4 replicates the 2 KV heads, a vocabulary of 41 pads the
last ranks' heads) give, on every rank, TP 1's CudaQwen3Model logprobs, and each rank's
parameter gradients are the slices of TP 1's (and the weights gathered back from the ranks
are the checkpoint's) -- to float64 rounding, since the stand-in's
additions are not the kernels'. Control: without the all-reduce of Megatron's f in the backward
the gradients are off. The bits are the GPU's to prove (tests/gpu/trainer_parity.py
--trainer_tp)."""

from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import traceback
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_cuda_lib  # noqa: E402
from rollout_trainer import CudaQwen3Model, CudaTpQwen3Model  # noqa: E402
from rollout_trainer import tp as tp_mod  # noqa: E402

H, HEADS, KV, HD, INTER, VOCAB, LAYERS = 32, 8, 2, 8, 64, 41, 2
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": H, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
    "intermediate_size": INTER, "vocab_size": VOCAB, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TEMPERATURE = 0.8
TOL = 2e-5  # relative: the fp32 residual and logits, summed in another order by the stand-in


def checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(torch.bfloat16).float()
    one = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).float()
    t = {"model.embed_tokens.weight": r(VOCAB, H), "model.norm.weight": one(H),
         "lm_head.weight": r(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": one(H), p + "post_attention_layernorm.weight": one(H),
                  p + "self_attn.q_proj.weight": r(HEADS * HD, H),
                  p + "self_attn.k_proj.weight": r(KV * HD, H),
                  p + "self_attn.v_proj.weight": r(KV * HD, H),
                  p + "self_attn.o_proj.weight": r(H, HEADS * HD),
                  p + "self_attn.q_norm.weight": one(HD), p + "self_attn.k_norm.weight": one(HD),
                  p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
                  p + "mlp.down_proj.weight": r(H, INTER)})
    return t


def batch():
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 6, 13, 22])
    return torch.randint(0, VOCAB, (22,), generator=g), cu


def logprobs_and_grads(model, tokens, cu, advantages):
    model.zero_grad(set_to_none=True)
    lp = model.logprobs(tokens, cu, TEMPERATURE)
    (-(lp * advantages).sum()).backward()
    grads = {}
    for name, (key, rows) in model._names.items():
        g = model.params[key].grad
        grads[name] = (g if rows is None else g[rows]).detach().clone()
    return lp.detach(), grads


def _rank_main(rank, tp, port, controls, queue):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp)
        with fake_cuda_lib.installed(wide=True):
            shard = tp_mod.shard_of(CONFIG, tp, rank)
            shards = {n: t[tp_mod.shard_index(n, shard, CONFIG) or ()]
                      for n, t in checkpoint().items()}
            model = CudaTpQwen3Model(CONFIG, shards, dist.group.WORLD, device="cpu")
            tokens, cu = batch()
            adv = torch.randn(tokens.numel(), generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64)
            lp, grads = logprobs_and_grads(model, tokens, cu, adv.float())
            out = {"lp": lp, "grads": grads}
            # The whole model gathered back is the checkpoint's, and loading it back leaves
            # every shard as it was.
            full = {n: w.to(torch.bfloat16) for n, w in checkpoint().items()}
            gathered = list(model.full_named_weights())
            apart = [n for n, w in gathered if not torch.equal(w, full[n])]
            before = {n: p.detach().clone() for n, p in model.named_weights()}
            model.load_weights(gathered)
            apart += [n + " (reloaded)" for n, p in model.named_weights()
                      if not torch.equal(p.detach(), before[n])]
            out["weights_apart"] = {n: torch.zeros(1) for n in apart}
            out["weights_count"] = torch.tensor([len(gathered)])
            if controls:
                backward = tp_mod._CopyToTp.backward
                tp_mod._CopyToTp.backward = staticmethod(lambda ctx, grad: (grad, None))
                try:
                    out["grads_without_f"] = logprobs_and_grads(model, tokens, cu, adv.float())[1]
                finally:
                    tp_mod._CopyToTp.backward = backward
        # numpy, not tensors: a tensor crosses the queue as shared memory this process unmaps
        # on exit.
        queue.put((rank, {k: (v.numpy() if torch.is_tensor(v) else
                              {n: g.numpy() for n, g in v.items()}) for k, v in out.items()}))
    except BaseException:  # noqa: B902 -- reported to the parent
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tp: int, controls: bool = False):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, controls, queue))
             for r in range(tp)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(tp):
            rank, out = queue.get(timeout=300)
            if isinstance(out, str):
                raise AssertionError(f"rank {rank} of {tp} raised:\n{out}")
            results[rank] = {k: (torch.from_numpy(v) if not isinstance(v, dict) else
                                 {n: torch.from_numpy(g) for n, g in v.items()})
                             for k, v in out.items()}
    except queue_module.Empty:
        raise AssertionError(f"TP {tp}: a rank did not report within 300 s")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(tp)]


_tp1 = None


def tp1():
    global _tp1
    if _tp1 is None:
        with fake_cuda_lib.installed(wide=True):
            model = CudaQwen3Model(CONFIG, checkpoint(), device="cpu")
            tokens, cu = batch()
            adv = torch.randn(tokens.numel(), generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64)
            _tp1 = logprobs_and_grads(model, tokens, cu, adv.float())
    return _tp1


def worst_grad_error(tp: int, rank: int, grads) -> tuple:
    _, full = tp1()
    shard = tp_mod.shard_of(CONFIG, tp, rank)
    worst = (0.0, "")
    for name, g in grads.items():
        want = full[name][tp_mod.shard_index(name, shard, CONFIG) or ()]
        scale = full[name].abs().max().item() or 1.0
        worst = max(worst, ((g - want).abs().max().item() / scale, name))
    return worst


class CudaTpWiringTest(unittest.TestCase):
    def check_degree(self, tp: int, controls: bool = False):
        lp1, _ = tp1()
        ranks = run_ranks(tp, controls)
        for rank, out in enumerate(ranks):
            err = (out["lp"] - lp1).abs().max().item()
            self.assertLess(err, TOL, f"TP {tp} rank {rank}: logprobs {err:.3e} from TP 1's")
            self.assertEqual(list(out["weights_apart"]), [],
                             f"TP {tp} rank {rank}: gathered weights apart from the checkpoint")
            self.assertEqual(int(out["weights_count"][0]), len(checkpoint()))
            worst = worst_grad_error(tp, rank, out["grads"])
            self.assertLess(worst[0], TOL, f"TP {tp} rank {rank}: gradient of {worst[1]} "
                                           f"{worst[0]:.3e} from TP 1's slice")
        return ranks

    def test_tp2_logprobs_and_gradient_slices_are_tp1s(self):
        ranks = self.check_degree(2, controls=True)
        # Control: without f's all-reduce, the column-parallel inputs' gradients miss the
        # other ranks' parts.
        worst = max(worst_grad_error(2, r, out["grads_without_f"])
                    for r, out in enumerate(ranks))
        self.assertGreater(worst[0], 1e-3, "dropping the all-reduce changed no gradient")

    def test_tp4_with_replicated_kv_heads_and_padded_vocab_is_tp1s(self):
        self.check_degree(4)

    def test_shards_of_the_wrong_shape_are_refused_by_name(self):
        shard = tp_mod.shard_of(CONFIG, 2, 0)
        shards = {n: t[tp_mod.shard_index(n, shard, CONFIG) or ()]
                  for n, t in checkpoint().items()}
        shards["model.layers.0.mlp.down_proj.weight"] = checkpoint()[
            "model.layers.0.mlp.down_proj.weight"]
        with self.assertRaisesRegex(ValueError, "down_proj.*rank 0 of 2"):
            tp_mod.check_shards(CONFIG, shard, shards)


if __name__ == "__main__":
    unittest.main()
