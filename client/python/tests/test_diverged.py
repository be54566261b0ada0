"""Weights that diverged, as a trainer sees them (review26 finding 4): generate() completions
end "abort" with an abort_cause naming the position and the version, score() raises
RolloutError FAILED_PRECONDITION saying the same, and server_info() counts the rows
(docs/api.md, "Non-finite logits"). Before, both returned finite logprobs of -log(vocab).

Run as the other test modules (client/python/run_tests.sh).
"""

from __future__ import annotations

import unittest

import numpy as np

from rollout_client import RolloutClient, RolloutError, read_safetensors

from _support import Server, cache_dir

NORM = "model.norm.weight"


class DivergedWeightsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(cache_dir())
        cls.client = RolloutClient(cls.server.target, timeout=120)
        info = cls.client.wait_ready(60)
        cls.original = read_safetensors(info.model.source, [NORM])[NORM]

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def generate(self):
        return self.client.generate([[1, 2, 3]], seed=1, temperature=0.7, max_new_tokens=4,
                                    top_logprobs=2)[0][0]

    def test_nan_weights_end_samples_and_fail_score_naming_the_version(self):
        healthy = self.generate()
        self.assertEqual(healthy.finish_reason, "length")
        self.assertEqual(healthy.abort_cause, "")
        self.assertEqual(self.client.server_info().counters.nonfinite_logit_rows, 0)

        nan = np.full(self.original.shape, np.nan, np.float32)
        self.client.update_weights([(NORM, nan)], version="py-diverged", dtype="F32")
        c = self.generate()
        self.assertEqual(c.finish_reason, "abort")
        self.assertEqual((c.token_ids, c.logprobs), ([], []))
        self.assertEqual(c.abort_cause,
                         "the model's logits for position 3 (generated token 0) are not finite "
                         "(NaN or Inf) under weight version 'py-diverged': the weights may have "
                         "diverged")
        with self.assertRaises(RolloutError) as raised:
            self.client.score([[1, 2, 3, 4]], starts=1)
        self.assertEqual(raised.exception.code, "FAILED_PRECONDITION")
        self.assertIn("sequences[0]: the model's logits for token_ids[1] are not finite",
                      raised.exception.message)
        self.assertIn("'py-diverged'", raised.exception.message)
        self.assertEqual(self.client.server_info().counters.nonfinite_logit_rows, 1 + 3)

        self.client.update_weights([(NORM, self.original)], version="py-restored", dtype=None)
        again = self.generate()
        self.assertEqual((again.token_ids, again.logprobs, again.finish_reason),
                         (healthy.token_ids, healthy.logprobs, healthy.finish_reason))
        self.assertEqual(len(self.client.score([[1, 2, 3, 4]], starts=1)[0]), 3)


if __name__ == "__main__":
    unittest.main()
