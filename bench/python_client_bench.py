#!/usr/bin/python3
"""Client CPU per token of the Python client, by stream mode (a benchmark, not a test).

    /usr/bin/python3 -m venv --system-site-packages VENV
    VENV/bin/pip install --no-index --no-build-isolation ./client/python
    build/bin/rollout-server --port 50051 &
    VENV/bin/python bench/python_client_bench.py --target 127.0.0.1:50051

One request of --samples samples x --tokens tokens (ignore_eos, so every sample runs to the
end) per mode and repeat; prints the median client CPU (this process, every thread: Python and
gRPC's) per generated token, the messages received and the wall time. Modes:
  per-token         generate(stream=True): a TokenChunk per step and sample, then completions
  coalesced-N       generate(stream=True, chunk_tokens=N)
  completions-only  generate(): the completions only (the blocking call's default)
  blocking-per-token  generate(completions_only=False): what generate() received before
                    stream options existed (every chunk, dropped, then the completions)
  aio-*             the same through rollout_client.aio
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import rollout_client
import rollout_client.aio


def measure(run, tokens):
    cpu, wall = time.process_time(), time.perf_counter()
    messages, got = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if got != tokens:
        raise SystemExit(f"expected {tokens} tokens, got {got}")
    return cpu, wall, messages


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    total = args.samples * args.tokens
    request = dict(num_samples=args.samples, seed=1, temperature=1.0,
                   max_new_tokens=args.tokens, ignore_eos=True)
    prompt = [[11, 12, 13, 14, 15, 16, 17, 18]]

    client = rollout_client.RolloutClient(args.target, timeout=600)
    info = client.wait_ready(60)

    def streamed(**options):
        def run():
            messages = got = 0
            for item in client.generate(prompt, stream=True, **request, **options):
                messages += 1
                if isinstance(item, rollout_client.Completion):
                    got += len(item.token_ids)
            return messages, got
        return run

    def blocking(**options):
        def run():
            groups = client.generate(prompt, **request, **options)
            return None, sum(len(c.token_ids) for g in groups for c in g)
        return run

    async def aio_streamed(aio, **options):
        messages = got = 0
        async for item in aio.generate(prompt, stream=True, **request, **options):
            messages += 1
            if isinstance(item, rollout_client.Completion):
                got += len(item.token_ids)
        return messages, got

    def aio(**options):
        def run():
            async def once():
                async with rollout_client.aio.RolloutClient(args.target, timeout=600) as c:
                    return await aio_streamed(c, **options)
            return asyncio.run(once())
        return run

    n = args.chunk_tokens
    modes = [
        ("per-token", streamed()),
        (f"coalesced-{n}", streamed(chunk_tokens=n)),
        ("completions-only", blocking()),
        ("blocking-per-token", blocking(completions_only=False)),
        ("aio-per-token", aio()),
        (f"aio-coalesced-{n}", aio(chunk_tokens=n)),
        ("aio-completions-only", aio(completions_only=True)),
    ]
    print(f"server {info.server_version} ({info.backend}), {args.samples} samples x "
          f"{args.tokens} tokens = {total} tokens per request, median of {args.repeats}")
    print(f"{'mode':24} {'client CPU us/token':>20} {'messages':>9} {'wall s':>7}")
    for name, run in modes:
        results = [measure(run, total) for _ in range(args.repeats)]
        cpu = statistics.median(r[0] for r in results)
        wall = statistics.median(r[1] for r in results)
        messages = results[0][2]
        shown = "-" if messages is None else str(messages)
        print(f"{name:24} {cpu / total * 1e6:20.2f} {shown:>9} {wall:7.2f}", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
