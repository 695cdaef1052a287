"""The watermark detector: z-scores equal transformers' WatermarkDetector on the same ids, and watermarked
generations are detected while plain ones are not."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import WatermarkDetector, generate
from support.decoding import model_pair

PROMPTS = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42], [1, 90, 3, 8]])


@pytest.mark.parametrize("config", [dict(bias=4.0), dict(bias=4.0, seeding_scheme="selfhash", context_width=2)],
                         ids=["lefthash", "selfhash"])
def test_detector_matches_transformers_and_separates(config: dict) -> None:
    from transformers.generation import WatermarkDetector as HFDetector
    from transformers.generation import WatermarkingConfig as HFConfig

    hf, ours = model_pair()
    kw = dict(max_new_tokens=30, do_sample=True, top_k=0, eos_token_id=None, seed=0)
    marked = generate(ours, PROMPTS, watermarking_config=config, **kw)[:, 4:]
    plain = generate(ours, PROMPTS, **kw)[:, 4:]
    mine = WatermarkDetector(96, config, bos_token_id=1)
    theirs = HFDetector(hf.config, "cpu", HFConfig(**config))
    for ids in (marked, plain):
        got = mine(ids)
        want = theirs(ids, return_dict=True)
        torch.testing.assert_close(torch.tensor(got.z_score), torch.tensor(want.z_score, dtype=torch.float32))
        assert got.num_green_tokens == want.num_green_tokens.tolist()
    assert min(mine(marked).z_score) > 3.0
    assert max(mine(plain).z_score) < 3.0
