"""Tests of rollout_client.aio (grpc.aio) against a real rollout-server on loopback: the same
results as the blocking client, concurrency on one event loop, streams left early, errors."""

from __future__ import annotations

import asyncio
import unittest

import numpy as np

import rollout_client
import rollout_client.aio
from rollout_client import RolloutClient, RolloutError, read_safetensors

from _support import shared_server, stop_shared_server

PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7, 7]]
NORM = "model.norm.weight"


def tearDownModule():
    stop_shared_server()


def key(c):
    return (c.token_ids, c.logprobs, c.finish_reason, c.sample_seed, c.top_logprobs)


def run(coro):
    return asyncio.run(coro)


class AioTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.target = shared_server().target
        with RolloutClient(cls.target, timeout=120) as blocking:
            blocking.wait_ready(60)

    def test_same_methods_as_the_blocking_client(self):
        public = {n for n in dir(RolloutClient) if not n.startswith("_")}
        self.assertEqual(public, {n for n in dir(rollout_client.aio.RolloutClient)
                                  if not n.startswith("_")})

    def test_generate_and_score_equal_the_blocking_clients(self):
        args = dict(num_samples=[2, 1, 3], seed=[5, 6, 7], temperature=0.8, max_new_tokens=12,
                    top_logprobs=2)
        with RolloutClient(self.target, timeout=120) as blocking:
            expected = [[key(c) for c in g] for g in blocking.generate(PROMPTS, **args)]
            info = blocking.server_info()

        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=120) as client:
                self.assertEqual((await client.wait_ready(30)).model, info.model)
                groups = await client.generate(PROMPTS, **args)
                seqs = [PROMPTS[c.prompt_index] + c.token_ids for g in groups for c in g]
                starts = [len(PROMPTS[c.prompt_index]) for g in groups for c in g]
                scores = await client.score(seqs, starts, temperature=0.8)
                return groups, scores

        groups, scores = run(main())
        self.assertEqual([[key(c) for c in g] for g in groups], expected)
        self.assertEqual(scores, [c.logprobs for g in groups for c in g])

    def test_release_and_resume_memory(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=120) as client:
                released = await client.release_memory()
                info = await client.server_info()
                resumed = await client.resume_memory()
                return released, info, resumed, await client.server_info()

        released, info, resumed, after = run(main())
        self.assertGreater(released.kv_cache_bytes, 0)
        self.assertEqual(info.memory_released.kv_cache_bytes, released.kv_cache_bytes)
        self.assertTrue(resumed.was_released)
        self.assertEqual(resumed.kv_cache_bytes, released.kv_cache_bytes)
        self.assertIsNone(after.memory_released)

    def test_concurrent_streams_on_one_loop_keep_their_bits(self):
        with RolloutClient(self.target, timeout=120) as blocking:
            expected = [key(blocking.generate([p], seed=i, max_new_tokens=20)[0][0])
                        for i, p in enumerate(PROMPTS * 3)]

        async def one(client, i, prompt):
            chunks, done = [], None
            async for item in client.generate([prompt], seed=i, max_new_tokens=20, stream=True,
                                              chunk_tokens=3):
                if isinstance(item, rollout_client.TokenChunk):
                    chunks += item.token_ids
                else:
                    done = item
            self.assertEqual(chunks, done.token_ids)
            return key(done)

        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=120) as client:
                return await asyncio.gather(*(one(client, i, p)
                                              for i, p in enumerate(PROMPTS * 3)))

        self.assertEqual(run(main()), expected)

    def test_a_stream_left_early_is_cancelled_on_the_server(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=120) as client:
                async for item in client.generate([PROMPTS[0]], max_new_tokens=2000,
                                                  ignore_eos=True, stream=True):
                    self.assertIsInstance(item, rollout_client.TokenChunk)
                    break
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 30
                while (await client.server_info()).counters.running_samples and \
                        loop.time() < deadline:
                    await asyncio.sleep(0.05)
                return (await client.server_info()).counters.running_samples

        self.assertEqual(run(main()), 0)

    def test_errors_are_rollout_errors_and_bad_arguments_raise_at_the_call(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=60) as client:
                with self.assertRaises(TypeError):
                    client.generate([[1, 2]])  # max_new_tokens missing: before any await
                with self.assertRaises(RolloutError) as e:
                    await client.generate([[1, 99999]], max_new_tokens=4)
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn("prompt_token_ids[1]", e.exception.message)
                with self.assertRaises(RolloutError) as e:
                    async for _ in client.generate([[1, 2]], max_new_tokens=4, top_p=2.0,
                                                   stream=True):
                        pass
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            async with rollout_client.aio.RolloutClient("127.0.0.1:1", timeout=5) as client:
                with self.assertRaises(RolloutError) as e:
                    await client.wait_ready(0.5)
                self.assertEqual(e.exception.code, "DEADLINE_EXCEEDED")

        run(main())

    def test_update_weights_from_the_event_loop(self):
        # A server of its own: the weights change.
        from _support import Server, cache_dir
        server = Server(cache_dir())
        try:
            async def main():
                async with rollout_client.aio.RolloutClient(server.target, timeout=120) as c:
                    info = await c.wait_ready(60)
                    tensor = read_safetensors(info.model.source, [NORM])[NORM]
                    before = await c.generate([PROMPTS[0]], max_new_tokens=8)
                    r = await c.update_weights([(NORM, tensor)], version="aio-1")
                    after = await c.generate([PROMPTS[0]], max_new_tokens=8)
                    return r, before[0][0], after[0][0], await c.server_info()

            r, before, after, info = run(main())
            self.assertEqual((r.version, r.previous_version, r.tensors_updated), ("aio-1", "0", 1))
            self.assertEqual(after.weight_version, "aio-1")
            self.assertEqual(key(after), key(before))  # the same bytes: the same bits
            self.assertEqual(info.counters.weight_updates, 1)
        finally:
            server.stop()

    def test_update_weights_over_several_streams(self):
        # A server of its own: the weights change. Two tensors over two streams, then a part
        # that the server refuses: every part fails, nothing is applied.
        from _support import Server, cache_dir
        import numpy as np
        server = Server(cache_dir())
        down = "model.layers.0.mlp.down_proj.weight"
        try:
            async def main():
                async with rollout_client.aio.RolloutClient(server.target, timeout=120) as c:
                    info = await c.wait_ready(60)
                    tensors = read_safetensors(info.model.source, [NORM, down])
                    r = await c.update_weights(tensors, version="aio-2", streams=2)
                    bad = dict(tensors)
                    bad[NORM] = np.ones(7, np.float32)
                    with self.assertRaises(RolloutError) as e:
                        await c.update_weights(bad, version="aio-bad", streams=2)
                    return r, e.exception, await c.server_info()

            r, error, info = run(main())
            self.assertEqual((r.version, r.tensors_updated, r.part_count), ("aio-2", 2, 2))
            self.assertEqual(error.code, "INVALID_ARGUMENT")
            self.assertEqual(info.weight_version, "aio-2")
            self.assertEqual(info.weight_digest, r.weight_digest)
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()


class AioArgumentCheckTest(unittest.TestCase):
    """Token ids, integer and float arguments and weights are checked as the blocking client
    checks them, before anything is sent: the target answers nothing, so an unchecked one would
    fail UNAVAILABLE."""

    def test_bad_token_ids_and_integers_raise_at_the_call(self):
        async def main():
            async with rollout_client.aio.RolloutClient("127.0.0.1:1", timeout=5) as client:
                with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = 1\.5: token ids "
                                                       r"must be integers, not float"):
                    client.generate([[1.5, 2.9]], max_new_tokens=3, temperature=0)
                with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = 1\.7: .*float32"):
                    client.generate([np.array([1.7, 2.2], np.float32)], max_new_tokens=3,
                                    stream=True)
                with self.assertRaisesRegex(ValueError, r"^prompts\[0\]\[0\] = 1099511627776: "
                                                        r"token ids must be < 2\*\*32"):
                    client.generate([np.array([2**40])], max_new_tokens=3)
                with self.assertRaisesRegex(ValueError, r"^generate: seed = -1 .*2\*\*64"):
                    client.generate([[1, 2]], max_new_tokens=3, seed=-1)
                with self.assertRaisesRegex(ValueError, r"^generate: seed = 18446744073709551616"):
                    client.generate([[1, 2]], max_new_tokens=3, seed=2**64)
                with self.assertRaisesRegex(ValueError, r"^generate: num_samples = -1 .*2\*\*32"):
                    client.generate([[1, 2]], max_new_tokens=3, num_samples=-1)
                with self.assertRaisesRegex(ValueError, r"^stop_token_ids\[0\] = -5: "):
                    client.generate([[1, 2]], max_new_tokens=3, stop_token_ids=[-5])
                with self.assertRaisesRegex(TypeError, r"^sequences\[0\]\[0\] = 1\.9: token ids "
                                                       r"must be integers, not float"):
                    await client.score([[1.9, 2.5, 3.99]], starts=1)
                with self.assertRaisesRegex(TypeError, r"^generate: temperature must be a number "
                                                       r"\(got str 'hot'\)$"):
                    client.generate([[1, 2]], max_new_tokens=3, temperature="hot")
                with self.assertRaisesRegex(TypeError, r"^generate: top_p must be a number "
                                                       r"\(got bool True\)$"):
                    client.generate([[1, 2]], max_new_tokens=3, top_p=True, stream=True)
                with self.assertRaisesRegex(TypeError, r"^score: temperature must be a number"):
                    await client.score([[1, 2, 3]], starts=1, temperature="hot")
                with self.assertRaisesRegex(TypeError, r"^update_weights: chunk_bytes must be an "
                                                       r"integer \(got float 1\.5\)$"):
                    await client.update_weights([("w", np.ones(2, np.float32))], "v",
                                                skip_tied=False, chunk_bytes=1.5)
                with self.assertRaisesRegex(TypeError, r"^tensor 'w': an array of int64 is "
                                                       r"refused, not converted"):
                    await client.update_weights([("w", np.ones(2, np.int64))], "v",
                                                skip_tied=False)
                with self.assertRaisesRegex(TypeError, r"^timeout must be a number"):
                    client.generate([[1, 2]], max_new_tokens=3, stream=True, timeout="5")

        run(main())
