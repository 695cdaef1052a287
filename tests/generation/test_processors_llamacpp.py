"""Processors transformers lacks, against hand-worked numbers from their definitions: OpenAI presence /
frequency penalties and logit_bias, llama.cpp's DRY, XTC, top-n-sigma and mirostat v2, and sampler_order."""

from __future__ import annotations

import math

import pytest
import torch

from nexttoken.errors import GenerationConfigError
from nexttoken.generation import GenerationConfig, generate
from nexttoken.generation.processors.llamacpp import DRY, XTC, MirostatV2, TopNSigma
from nexttoken.generation.processors.penalties import FrequencyPenalty, LogitBias, PresencePenalty
from nexttoken.generation.processors import build_processors
from nexttoken.generation.processors.warpers import Temperature, TopK
from support.decoding import PROMPTS, left_padded, model_pair

INF = float("inf")


# ---- OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, c counting generated tokens only
# (platform.openai.com/docs/advanced-usage#frequency-and-presence-penalties); logit_bias adds to the logits.
def test_openai_presence_and_frequency_hand_worked() -> None:
    ids = torch.tensor([[5, 5, 3, 3, 3, 7]])  # prompt [5, 5], generated [3, 3, 3, 7]
    scores = torch.zeros(1, 10)
    pres = PresencePenalty(0.5, prompt_length=2)(ids, scores)
    freq = FrequencyPenalty(0.25, prompt_length=2)(ids, scores)
    want_pres = torch.zeros(1, 10)
    want_pres[0, 3] = want_pres[0, 7] = -0.5
    want_freq = torch.zeros(1, 10)
    want_freq[0, 3], want_freq[0, 7] = -0.75, -0.25
    assert torch.equal(pres, want_pres) and torch.equal(freq, want_freq)  # token 5 (prompt only) untouched


def test_openai_logit_bias_accepts_json_keys() -> None:
    out = LogitBias({"3": -100, 4: 2.5})(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 6))
    assert out.tolist() == [[1.0, 1.0, 1.0, -99.0, 3.5, 1.0]]
    with pytest.raises(GenerationConfigError):
        GenerationConfig().updated(logit_bias={"3": 150})


def test_openai_penalties_in_generate() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    out = generate(ours, ids, attention_mask=mask, max_new_tokens=6, presence_penalty=1.5, frequency_penalty=0.7,
                   logit_bias={17: 3.0, "40": -100}, eos_token_id=None, pad_token_id=0, output_scores=True,
                   output_logits=True, return_dict_in_generate=True)
    P = ids.shape[1]
    for t, (logits, scores) in enumerate(zip(out.logits, out.scores)):
        counts = torch.zeros_like(logits)
        for row in range(3):
            for tok in out.sequences[row, P : P + t].tolist():
                counts[row, tok] += 1
        want = logits - 1.5 * (counts > 0).float() - 0.7 * counts
        want[:, 17] += 3.0
        want[:, 40] -= 100
        torch.testing.assert_close(scores, want)


# ---- DRY (oobabooga/text-generation-webui PR #5677; llama.cpp --dry-*): penalty multiplier * base ** (n - allowed)
def test_dry_hand_worked() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3]])  # suffix [1, 2, 3] occurred before, followed by 4: n = 3
    out = DRY(0.8, 1.75, 2)(ids, torch.zeros(1, 6))
    want = torch.zeros(1, 6)
    want[0, 4] = -0.8 * 1.75 ** (3 - 2)
    torch.testing.assert_close(out, want)
    # n = 1 < allowed_length: suffix [.., 9, 3] vs earlier [2, 3] share only the last token
    assert torch.equal(DRY(0.8, 1.75, 2)(torch.tensor([[1, 2, 3, 4, 9, 3]]), torch.zeros(1, 10)), torch.zeros(1, 10))
    # a sequence breaker (token 2) stops the match from extending: n = 1
    assert torch.equal(DRY(0.8, 1.75, 2, 0, [2])(ids, torch.zeros(1, 6)), torch.zeros(1, 6))
    # penalty_last_n = 4 only searches [4, 1, 2, 3]: no earlier 3
    assert torch.equal(DRY(0.8, 1.75, 2, 4)(ids, torch.zeros(1, 6)), torch.zeros(1, 6))
    # the longest match wins per token: [5, 5, 5, 5] -> after [5, 5, 5] came 5 (n = 3)
    out = DRY(1.0, 2.0, 1)(torch.tensor([[5, 5, 5, 5]]), torch.zeros(1, 6))
    assert out[0, 5].item() == pytest.approx(-(2.0 ** (3 - 1)))


# ---- XTC (text-generation-webui PR #6335; llama.cpp llama_sampler_xtc)
def test_xtc_hand_worked() -> None:
    scores = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = XTC(0.15, 1.0, seed=0)(None, scores)  # 0.4, 0.3, 0.2 reach 0.15: all but the least likely (0.2) go
    assert torch.isneginf(out).tolist() == [[True, True, False, False]]
    assert torch.equal(XTC(0.35, 1.0, seed=0)(None, scores), scores)  # one token above: nothing removed
    assert torch.equal(XTC(0.15, 0.0, seed=0)(None, scores), scores)  # probability 0: never


def test_xtc_fires_with_its_probability() -> None:
    scores = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(4000, -1)
    fired = torch.isneginf(XTC(0.15, 0.3, seed=1)(None, scores)[:, 0]).float().mean().item()
    assert abs(fired - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 4000)


# ---- top-n-sigma (arXiv:2411.07641; llama.cpp): keep logits >= max - n * std (population std of finite logits)
def test_top_n_sigma_hand_worked() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -INF]])  # mean 1.5, std sqrt(5/4) = 1.118
    assert torch.isneginf(TopNSigma(1.0)(None, logits)).tolist() == [[False, False, True, True, True]]
    assert torch.isneginf(TopNSigma(2.0)(None, logits)).tolist() == [[False, False, False, True, True]]
    assert torch.isneginf(TopNSigma(0.0)(None, logits)).tolist() == [[False, True, True, True, True]]
    # temperature-invariant: the mask is the same on logits / T
    assert torch.equal(torch.isneginf(TopNSigma(1.0)(None, logits / 0.3)), torch.isneginf(TopNSigma(1.0)(None, logits)))


# ---- mirostat v2 (arXiv:2007.14966 Alg. 2; llama.cpp llama_sampler_mirostat_v2)
def test_mirostat_v2_hand_worked() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])  # surprises 1, 2, 3, 3 bits
    m = MirostatV2(tau=1.25, eta=0.1, seed=0)  # mu starts at 2 * tau = 2.5: tokens 0 and 1 stay, p = 2/3, 1/3
    kept = m.truncate(probs.log())
    torch.testing.assert_close(kept.softmax(-1), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    token = int(m(probs.log()))
    surprise = -math.log2([2 / 3, 1 / 3][token])
    assert m.mu is not None and m.mu.item() == pytest.approx(2.5 - 0.1 * (surprise - 1.25), abs=1e-5)


def test_mirostat_v2_first_draw_frequencies() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).expand(6000, -1)
    tokens = MirostatV2(tau=1.25, eta=0.1, seed=3)(probs.log())
    freq = torch.bincount(tokens, minlength=4).float() / 6000
    torch.testing.assert_close(freq, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), atol=0.03, rtol=0)


def test_mirostat_generate_is_seeded() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, mirostat_tau=3.0, mirostat_eta=0.2, top_k=0)
    assert torch.equal(generate(ours, ids, seed=5, **kw), generate(ours, ids, seed=5, **kw))


# ---- sampling chain order
def test_sampler_order_reorders_the_warpers() -> None:
    cfg = GenerationConfig(do_sample=True, temperature=0.5, top_k=5)
    default = [type(p) for p in build_processors(cfg).processors]
    custom = [type(p) for p in build_processors(cfg.updated(sampler_order=["top_k", "temperature"])).processors]
    assert default == [Temperature, TopK] and custom == [TopK, Temperature]
    with pytest.raises(GenerationConfigError, match="leaves out"):
        build_processors(cfg.updated(sampler_order=["top_k"]))
    with pytest.raises(GenerationConfigError):
        cfg.updated(sampler_order=["nonsense"])


def test_llamacpp_options_run_in_generate() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, dry_multiplier=0.8, xtc_probability=0.5,
              xtc_threshold=0.05, top_n_sigma=1.5, top_k=0, sampler_order=["top_n_sigma", "xtc"], seed=2,
              return_dict_in_generate=True, output_scores=True)
    a, b = generate(ours, ids, **kw), generate(ours, ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    new = a.sequences[:, ids.shape[1] :]
    for t, s in enumerate(a.scores):  # every sampled token survived the chain
        assert torch.isfinite(s.gather(1, new[:, t : t + 1])).all()
