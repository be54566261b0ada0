#!/usr/bin/python3
"""A GRPO-shaped loop against a running rollout server.

    /usr/bin/python3 -m venv --system-site-packages VENV     # sees Debian's grpcio, numpy
    VENV/bin/pip install --no-index --no-build-isolation ./client/python
    build/bin/rollout-server --port 50051 &                   # the embedded demo model
    VENV/bin/python client/python/examples/grpo_loop.py --target 127.0.0.1:50051

Each round samples a group of `--group-size` completions per prompt (one rollout with
num_samples = G; sample j gets its own derived seed), scores them with a toy reward (the
fraction of even token ids), and prints group-normalised advantages (r - mean) / (std + eps).
A real trainer would now take a gradient step; here the "step" nudges one weight tensor
(`model.norm.weight` by default, read from the served checkpoint with the package's tiny
safetensors reader) and pushes it with update_weights(version="step-k"). The next round must
report the new version in every completion and, with the same seeds, produce different tokens.
The server also re-scores last round's samples under the new weights (the PPO/GRPO ratio
inputs). At the end the tensor that was served when the loop started is pushed back under the
version it had, and the weights digest (or, where the server reports none, a probe scored before
and after) proves the weights are those again.

The tensor is read from the checkpoint that holds the served weights: the server's start
checkpoint (ModelInfo.source) while no update happened since it started, else --model-dir
(the loop refuses to guess). Exits 1 if a round's completions do not carry the pushed version,
its tokens did not change, or the restored weights are not those that were served.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from rollout_client import RolloutClient, RolloutError, bf16_bits_to_f32, read_safetensors


def reward(token_ids):
    """Toy reward: the fraction of even token ids."""
    return sum(1 for t in token_ids if t % 2 == 0) / max(1, len(token_ids))


def advantages(rewards, eps=1e-6):
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards], mean, std


def nudged(original_f32, step):
    """The 'optimizer step': an elementwise, step-dependent rescale of the tensor."""
    i = np.arange(original_f32.size, dtype=np.float32).reshape(original_f32.shape)
    return original_f32 * (1.0 + 0.5 * np.sin(0.37 * i + step)).astype(np.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tensor", default="model.norm.weight")
    p.add_argument("--model-dir", default=None,
                   help="checkpoint folder holding the served weights, to read the tensor "
                        "from (default: the server's start checkpoint from GetServerInfo, if "
                        "no update happened since it started; the server must be local)")
    p.add_argument("--no-restore", action="store_true",
                   help="leave the last pushed weights on the server")
    args = p.parse_args(argv)

    failures = []
    with RolloutClient(args.target, token=args.token, timeout=300) as client:
        info = client.wait_ready(60)
        m = info.model
        print(f"server {info.server_version} ({info.backend}): {m.architecture}, "
              f"{m.num_layers} layers, vocab {m.vocab_size}, eos {m.eos_token_ids}, "
              f"weights '{info.weight_version}' from {m.source}")
        model_dir = args.model_dir
        if model_dir is None:
            if info.counters.weight_updates > 0:
                print(f"the server's weights were updated {info.counters.weight_updates} times "
                      f"since it started (now '{info.weight_version}'), so {m.source} no longer "
                      "holds what it serves; pass --model-dir with the checkpoint that does")
                return 2
            model_dir = m.source
        # What was served, to put back at the end (read from the checkpoint that holds it).
        original = read_safetensors(model_dir, [args.tensor])[args.tensor]
        if original.dtype != "BF16":
            print(f"this example nudges a BF16 tensor; {args.tensor} is {original.dtype}")
            return 2
        original_f32 = bf16_bits_to_f32(
            np.frombuffer(original.data, dtype=np.uint16)).reshape(original.shape)
        print(f"nudging {args.tensor} {list(original.shape)} {original.dtype} each round")

        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, m.vocab_size, size=int(rng.integers(4, 12))).tolist()
                   for _ in range(args.prompts)]
        # Teacher-forced logprobs of a fixed sequence under the served weights, to check the
        # restore against (equal weights give equal bits).
        probe = rng.integers(3, m.vocab_size, size=24).tolist()
        probe_before = client.score([probe], starts=1)[0]
        seeds = [1000 + i for i in range(args.prompts)]  # the same every round
        version = info.weight_version
        previous = None  # last round's (prompts, completions) for re-scoring
        previous_tokens = None
        for k in range(args.rounds):
            groups = client.generate(prompts, num_samples=args.group_size, seed=seeds,
                                     temperature=args.temperature,
                                     max_new_tokens=args.max_new_tokens)
            aborted = [c for g in groups for c in g if c.finish_reason == "abort"]
            if aborted:
                # Cut short (a cancel, an ABORT update, or logits that are not finite: weights
                # that diverged): a trainer must not train on these samples.
                failures.append(f"round {k}: {len(aborted)} samples aborted, the first by: "
                                f"{aborted[0].abort_cause or 'no cause given'}")
                break
            versions = {c.weight_version for g in groups for c in g}
            tokens = [[c.token_ids for c in g] for g in groups]
            n_tok = sum(len(t) for g in tokens for t in g)
            print(f"\n== round {k}: weights {sorted(versions)}, {len(groups)} groups x "
                  f"{args.group_size} samples, {n_tok} tokens")
            if versions != {version}:
                failures.append(f"round {k}: completions carry {sorted(versions)}, "
                                f"expected '{version}'")
            if previous_tokens is not None:
                changed = sum(a != b for ga, gb in zip(tokens, previous_tokens)
                              for a, b in zip(ga, gb))
                print(f"   samples that changed since the previous weights: {changed}/"
                      f"{args.prompts * args.group_size}")
                if changed == 0:
                    failures.append(f"round {k}: outputs identical to round {k - 1}")
            all_rewards = []
            for i, g in enumerate(groups):
                rewards = [reward(c.token_ids) for c in g]
                adv, mean, std = advantages(rewards)
                all_rewards += rewards
                finish = {}
                for c in g:
                    finish[c.finish_reason] = finish.get(c.finish_reason, 0) + 1
                print(f"   prompt {i}: reward mean {mean:.3f} std {std:.3f}  advantages "
                      + " ".join(f"{a:+.2f}" for a in adv) + f"  {finish}")
            print(f"   mean reward {sum(all_rewards) / len(all_rewards):.3f}")

            if previous is not None:
                # What a trainer does with the sampling logprobs: compare them with the current
                # policy's (here: the server's teacher-forced logprobs under the new weights).
                p_prompts, p_groups = previous
                seqs, starts, old = [], [], []
                for prompt, g in zip(p_prompts, p_groups):
                    for c in g:
                        seqs.append(prompt + c.token_ids)
                        starts.append(len(prompt))
                        old.append(c.logprobs)
                new = client.score(seqs, starts, temperature=args.temperature)
                diffs = [abs(a - b) for o, n in zip(old, new) for a, b in zip(o, n)]
                print(f"   last round's samples re-scored under '{version}': mean |log ratio| "
                      f"{sum(diffs) / max(1, len(diffs)):.4f}")
            previous = (prompts, groups)
            previous_tokens = tokens

            if k + 1 < args.rounds:
                version = f"step-{k + 1}"
                step_weights = [(args.tensor, nudged(original_f32, k + 1))]
                try:
                    r = client.update_weights(step_weights, version=version, policy="drain",
                                              dtype="BF16")
                except RolloutError as e:
                    if e.code != "FAILED_PRECONDITION":
                        raise
                    # A re-run against the same server: the name was served with other weights,
                    # and a version name is bound to its bytes. A trainer names versions by run.
                    version = f"{version}-{time.strftime('%H%M%S')}"
                    print(f"-> '{e.message[:60]}...': pushing as '{version}'")
                    r = client.update_weights(step_weights, version=version, policy="drain",
                                              dtype="BF16")
                print(f"-> pushed {r.tensors_updated} tensor ({r.bytes_received} bytes) as "
                      f"'{r.version}' (was '{r.previous_version}'), receive "
                      f"{r.receive_seconds * 1e3:.1f} ms, swap {r.swap_seconds * 1e3:.1f} ms")

        if not args.no_restore and args.rounds > 1:
            try:
                r = client.update_weights([(args.tensor, original)], version=info.weight_version)
            except RolloutError as e:
                print(f"restoring as '{info.weight_version}' failed ({e}); retrying as "
                      f"'{info.weight_version}-restored'")
                r = client.update_weights([(args.tensor, original)],
                                          version=f"{info.weight_version}-restored")
            # The weights digest proves it exactly; a server that cannot hash its weights
            # reports none, and then the probe's bits do.
            if info.weight_digest:
                same = client.server_info().weight_digest == info.weight_digest
                proof = f"the weights digest is the start's again, {info.weight_digest[:19]}..."
            else:
                same = client.score([probe], starts=1)[0] == probe_before
                proof = "the probe's logprobs are those of the start again"
            if same:
                print(f"\nrestored the served {args.tensor} as '{r.version}' ({proof})")
            else:
                failures.append(f"after restoring {args.tensor} from {model_dir} the weights "
                                "differ from the start's: that checkpoint does not hold the "
                                "weights that were served")

    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: every round carried its pushed version and the outputs changed with the weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
