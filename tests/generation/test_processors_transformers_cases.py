"""transformers' own numeric cases for its logits processors, ported with their expected numbers
(huggingface/transformers tests/generation/test_logits_process.py), plus purity (no in-place change) and
constructor validation for every nexttoken processor."""

from __future__ import annotations


import pytest
import torch

from nexttoken.errors import GenerationConfigError
from nexttoken.generation.processors.constraints import (
    ExponentialDecayLengthPenalty, ForcedBOS, ForcedEOS, LogitNormalization, MinLength, MinNewTokens,
    PrefixConstrained, RemoveInvalidValues, SuppressTokens, SuppressTokensAtBegin
)
from nexttoken.generation.processors.guidance import ClassifierFreeGuidance
from nexttoken.generation.processors.llamacpp import DRY, XTC, TopNSigma
from nexttoken.generation.processors.penalties import (
    EncoderNoRepeatNGram, EncoderRepetitionPenalty, FrequencyPenalty, LogitBias, NoBadWords, NoRepeatNGram,
    PresencePenalty, RepetitionPenalty, SequenceBias
)
from nexttoken.generation.processors import ProcessorChain
from nexttoken.generation.processors.warpers import Epsilon, Eta, MinP, Temperature, TopH, TopK, TopP, Typical
from nexttoken.generation.processors.watermark import Watermark

INF = float("inf")


def uniform(batch: int, length: int) -> torch.Tensor:
    return torch.ones((batch, length)) / length


def ids_tensor(shape: tuple[int, int], vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))


def ramp(batch: int, vocab: int) -> torch.Tensor:
    return torch.arange(vocab, dtype=torch.float).unsqueeze(0).repeat(batch, 1)


def test_min_length() -> None:
    proc = MinLength(10, 0)
    assert proc(ids_tensor((4, 5), 20), uniform(4, 20))[:, 0].tolist() == 4 * [-INF]
    assert not torch.isinf(proc(ids_tensor((4, 15), 20), uniform(4, 20))).any()


@pytest.mark.parametrize("eos", [0, [0, 18]])
def test_min_new_tokens(eos) -> None:
    proc = MinNewTokens(5, 3, eos)
    expected = 4 * [-INF] * (len(eos) if isinstance(eos, list) else 1)
    for length in (5, 2, 6, 7):
        assert proc(ids_tensor((4, length), 20), uniform(4, 20))[:, eos].flatten().tolist() == expected
    for length in (8, 15):
        assert not torch.isinf(proc(ids_tensor((4, length), 20), uniform(4, 20))).any()


def test_temperature() -> None:
    scores = uniform(2, 20)
    scores[1, 5] = 1 / 20 + 0.1
    scores[1, 10] = 1 / 20 - 0.4
    probs = scores.softmax(-1)
    sharp = Temperature(0.5)(None, scores).softmax(-1)
    smooth = Temperature(1.3)(None, scores).softmax(-1)
    torch.testing.assert_close(probs[0], sharp[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(probs[0], smooth[0], rtol=1e-3, atol=1e-3)
    assert probs[1].max() < sharp[1].max() and probs[1].min() > sharp[1].min()
    assert probs[1].max() > smooth[1].max() and probs[1].min() < smooth[1].min()


def _rep_scores() -> torch.Tensor:
    scores = uniform(2, 10)
    scores[0, 0] = -(1 / 10)
    scores[1, 5] = 4 / 10
    return scores


def test_repetition_penalty() -> None:
    out = RepetitionPenalty(2.0)(torch.tensor([[0, 1], [5, 0]]), _rep_scores())
    assert out[0, 0].item() == pytest.approx(-(1 / 10) * 2)
    assert out[0, 1].item() == pytest.approx((1 / 10) / 2)
    assert out[1, 0].item() == pytest.approx((1 / 10) / 2)
    assert out[1, 5].item() == pytest.approx((4 / 10) / 2)


def test_repetition_penalty_prompt_ignore_length() -> None:
    scores = _rep_scores()
    ignore = torch.tensor([2, 2])
    assert torch.equal(RepetitionPenalty(2.0, ignore)(torch.tensor([[0, 1], [5, 0]]), scores), scores)
    out = RepetitionPenalty(2.0, ignore)(torch.tensor([[0, 1, 0, 1], [5, 0, 5, 0]]), scores)
    assert out[0, 0].item() == pytest.approx(-(1 / 10) * 2)
    assert out[1, 5].item() == pytest.approx((4 / 10) / 2)


def test_encoder_repetition_penalty() -> None:
    ids = torch.tensor([[0, 1], [5, 0]])
    out = EncoderRepetitionPenalty(2.0, ids)(ids, _rep_scores())
    assert out[0, 0].item() == pytest.approx(-(1 / 10) / 2)
    assert out[0, 1].item() == pytest.approx((1 / 10) * 2)
    assert out[1, 0].item() == pytest.approx((1 / 10) * 2)
    assert out[1, 5].item() == pytest.approx((4 / 10) * 2)
    assert out[0, 2].item() == pytest.approx(1 / 10) and out[1, 2].item() == pytest.approx(1 / 10)


def test_top_k() -> None:
    logits = ramp(2, 10)
    logits[1:, :5] += 10
    out = TopK(3)(None, logits)
    assert torch.isinf(out[0]).tolist() == 7 * [True] + 3 * [False]
    assert torch.isinf(out[1]).tolist() == 2 * [True] + 3 * [False] + 5 * [True]
    safety = TopK(1, min_tokens_to_keep=3)
    assert torch.isinf(safety(None, uniform(2, 5))).sum(-1).tolist() == [0, 0]
    assert torch.isinf(safety(None, ramp(2, 5))).sum(-1).tolist() == [2, 2]


def test_top_p() -> None:
    dist = torch.log(torch.tensor([[0.3, 0.1, 0.1, 0.5], [0.15, 0.3, 0.3, 0.25]]))
    expected = torch.tensor([[0.3, 0.0, 0.0, 0.5], [0.0, 0.3, 0.3, 0.25]])
    torch.testing.assert_close(TopP(0.8)(None, dist).exp(), expected, rtol=1e-3, atol=1e-3)
    logits = ramp(2, 10) - 5
    logits[1] *= 100.0
    assert (~torch.isinf(TopP(0.9, min_tokens_to_keep=2)(None, logits))).sum(-1).tolist() == [3, 2]


@pytest.mark.parametrize("probs,top_h,expected", [
    ([0.97, 0.01, 0.01, 0.01], 0.3, [0.97, 0.0, 0.0, 0.0]),
    ([0.4, 0.3, 0.2, 0.1], 0.7, [0.4, 0.3, 0.0, 0.0]),
    ([0.25, 0.25, 0.25, 0.25], 1.0, [0.25, 0.25, 0.25, 0.25]),
    ([0.75, 0.25, 0.0, 0.0], 0.4, [0.75, 0.0, 0.0, 0.0]),
])
def test_top_h(probs, top_h, expected) -> None:
    out = TopH(top_h)(None, torch.log(torch.tensor([probs]))).exp()
    torch.testing.assert_close(out, torch.tensor([expected]), rtol=1e-3, atol=1e-3)


def test_min_p() -> None:
    dist = torch.log(torch.tensor([[0.9, 0.0274, 0.047, 0.0274], [0.15, 0.3, 0.3, 0.25], [0.97, 0.01, 0.01, 0.01]]))
    expected = torch.tensor([[0.9, 0.0, 0.047, 0.0], [0.15, 0.3, 0.3, 0.25], [0.97, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(MinP(0.05)(None, dist).exp(), expected, rtol=1e-3, atol=1e-3)
    logits = ramp(2, 10) - 5
    logits[1] *= 100.0
    assert (~torch.isinf(MinP(0.9, min_tokens_to_keep=2)(None, logits))).sum(-1).tolist() == [2, 2]


def test_typical() -> None:
    dist = torch.log(torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.4, 0.2, 0.2, 0.2]]))
    expected = torch.tensor([[0.97, 0.0, 0.0, 0.0], [0.0, 0.2, 0.2, 0.2]])
    torch.testing.assert_close(Typical(0.5)(None, dist).exp(), expected, rtol=1e-3, atol=1e-3)
    assert torch.isinf(Typical(0.5, min_tokens_to_keep=3)(None, uniform(2, 5))).sum(-1).tolist() == [0, 0]
    logits = ramp(2, 10) - 5
    logits[1] *= 100.0
    assert (~torch.isinf(Typical(0.7, min_tokens_to_keep=2)(None, logits))).sum(-1).tolist() == [2, 2]


def test_epsilon() -> None:
    dist = torch.log(torch.tensor([[0.87, 0.099, 0.001, 0.03], [0.4, 0.299, 0.101, 0.2]]))
    expected = torch.tensor([[0.87, 0, 0, 0], [0.4, 0.299, 0.101, 0.2]])
    torch.testing.assert_close(Epsilon(0.1)(None, dist).exp(), expected, rtol=1e-3, atol=1e-3)
    logits = ramp(2, 10) - 5
    logits[1] *= 100.0
    assert (~torch.isinf(Epsilon(5e-2, min_tokens_to_keep=2)(None, logits))).sum(-1).tolist() == [3, 2]


def test_eta() -> None:
    dist = torch.log(torch.tensor([[0.0, 0.1, 0.8, 0.1], [0.01, 0.04, 0.9, 0.05]]))
    expected = torch.tensor([[0.0, 0.1, 0.8, 0.1], [0.0, 0.0, 0.9, 0.0]])
    torch.testing.assert_close(Eta(0.0625)(None, dist).exp(), expected, rtol=1e-3, atol=1e-3)
    logits = ramp(2, 10) - 5
    logits[1] *= 100.0
    assert (~torch.isinf(Eta(0.1, min_tokens_to_keep=2)(None, logits))).sum(-1).tolist() == [2, 2]


def test_no_repeat_ngram() -> None:
    ids = torch.tensor([[1, 1, 2, 1], [0, 1, 0, 1]])
    assert torch.isinf(NoRepeatNGram(2)(ids, uniform(2, 3))).tolist() == [[False, True, True], [True, False, False]]
    assert torch.isinf(NoRepeatNGram(3)(ids, uniform(2, 3))).tolist() == [[False, False, False], [True, False, False]]
    out = NoRepeatNGram(3)(torch.tensor([[1, 2, 5, 7, 8, 5, 1, 2]]), uniform(1, 10))
    assert torch.isinf(out).nonzero()[:, 1].tolist() == [5]
    assert not torch.isinf(NoRepeatNGram(3)(torch.tensor([[1, 2], [0, 1]]), uniform(2, 3))).any()


def test_encoder_no_repeat_ngram() -> None:
    prompt = torch.tensor([[1, 2, 1, 1]])
    ids = torch.tensor([[1, 2, 1], [8, 0, 2]])  # two beams of one prompt
    assert torch.isinf(EncoderNoRepeatNGram(2, prompt)(ids, uniform(2, 3))).tolist() == [
        [False, True, True], [False, True, False]]
    assert torch.isinf(EncoderNoRepeatNGram(3, prompt)(ids, uniform(2, 3))).tolist() == [
        [False, True, False], [False, False, False]]
    prompts = torch.tensor([[1, 2, 1, 1], [0, 0, 2, 1]])
    ids = torch.tensor([[1, 2, 1], [1, 0, 2], [0, 0, 0], [0, 2, 2]])
    assert torch.isinf(EncoderNoRepeatNGram(2, prompts)(ids, uniform(4, 3))).tolist() == [
        [False, True, True], [False, True, False], [True, False, True], [False, True, False]]
    assert torch.isinf(EncoderNoRepeatNGram(3, prompts)(ids, uniform(4, 3))).tolist() == [
        [False, True, False], [False, False, False], [False, False, True], [False, False, False]]


def test_no_bad_words() -> None:
    ids = torch.tensor([[0, 1, 3, 1], [0, 1, 0, 1]])
    proc = NoBadWords([[1], [4], [1, 0], [0, 1, 2], [1, 3, 1, 3]], eos_ids=[4])
    assert torch.isinf(proc(ids, uniform(2, 5))).tolist() == [
        [True, True, False, True, False], [True, True, True, False, False]]
    scores = uniform(2, 5)
    torch.testing.assert_close(NoBadWords([[4]], eos_ids=[4])(ids, scores), scores)


def test_sequence_bias() -> None:
    ids = torch.tensor([[0, 1, 3, 1], [0, 1, 0, 1]])
    bias = {(1,): 100.0, (4,): 100.0, (1, 0): -100.0, (0, 1, 2): -100.0, (1, 3, 1, 3): -100.0,
            (1, 3, 1, 3, 1, 3): -100.0}
    out = SequenceBias(bias)(ids, torch.zeros(2, 5))
    assert out.tolist() == [[-100.0, 100.0, 0.0, -100.0, 100.0], [-100.0, 100.0, -100.0, 0.0, 100.0]]


def test_processor_chain_equals_sequential_application() -> None:
    ids = ids_tensor((4, 10), 15)
    ids_copy = ids.clone()
    procs = [MinLength(10, 0), Temperature(0.5), RepetitionPenalty(2.0), TopK(3), TopP(0.8), NoRepeatNGram(2),
             NoBadWords([[1]], eos_ids=[0])]
    scores = uniform(4, 15)
    expected = scores
    for p in procs:
        expected = p(ids, expected)
    torch.testing.assert_close(ProcessorChain(procs)(ids, scores), expected, rtol=1e-3, atol=1e-3)
    assert torch.equal(ids, ids_copy)


def test_prefix_constrained() -> None:
    ids = torch.tensor([[0, 1, 3, 1], [0, 1, 0, 1]])
    out = PrefixConstrained(lambda b, _: [[0, 1], [2, 3]][b], 1)(ids, uniform(2, 5))
    assert torch.isinf(out).tolist() == [[False, False, True, True, True], [True, True, False, False, True]]
    with pytest.raises(ValueError):
        PrefixConstrained(lambda b, _: [], 1)(ids, uniform(2, 5))


def test_forced_bos_and_eos() -> None:
    out = ForcedBOS(0)(ids_tensor((4, 1), 20), uniform(4, 20))
    assert torch.isneginf(out[:, 1:]).all() and out[:, 0].tolist() == 4 * [0]
    assert not torch.isinf(ForcedBOS(0)(ids_tensor((4, 4), 20), uniform(4, 20))).any()
    out = ForcedEOS(5, 0)(ids_tensor((4, 4), 20), uniform(4, 20))
    assert torch.isneginf(out[:, 1:]).all() and out[:, 0].tolist() == 4 * [0]
    assert not torch.isinf(ForcedEOS(5, 0)(ids_tensor((4, 3), 20), uniform(4, 20))).any()


def test_remove_invalid_values() -> None:
    scores = torch.tensor([[0.0, 0.7, 0.8, float("nan")], [0.1, INF, 0.3, -INF]])
    info = torch.finfo(torch.float32)
    expected = torch.tensor([[0.0, 0.7, 0.8, 0.0], [0.1, info.max, 0.3, info.min]])
    assert torch.allclose(RemoveInvalidValues()(ids_tensor((2, 4), 20), scores), expected, atol=1e-6)


def test_exponential_decay_length_penalty() -> None:
    proc = ExponentialDecayLengthPenalty((5, 1.1), 0, prompt_length=2)
    scores = uniform(4, 20)
    assert proc(ids_tensor((4, 2), 20), scores)[:, 0].tolist() == scores[:, 0].tolist()
    assert (proc(ids_tensor((4, 20), 20), scores)[:, 0] > scores[:, 0]).all()
    negative = -uniform(4, 20)
    assert (proc(ids_tensor((4, 20), 20), negative)[:, 0] > negative[:, 0]).all()


def test_normalization() -> None:
    scores = torch.tensor([[-23.18, -29.96, -43.54, 47.77], [-33.58, -26.87, -32.96, 22.51]])
    probs = LogitNormalization()(None, scores).exp()
    assert probs.sum(-1).allclose(torch.ones(2)) and probs.allclose(scores.softmax(-1))


class _FixedLogitsModel:
    """A stand-in model whose logits are fixed: what transformers' CFG test uses."""

    config = type("C", (), {"sliding_window": None})()

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def new_cache(self, batch: int, length: int) -> None:
        return None

    def __call__(self, ids, batch, cache):  # noqa: ANN001, ANN204
        return self.logits.expand(ids.shape[0], -1)


@pytest.mark.parametrize("negative", ["explicit_with_mask", "explicit", "implicit"])
def test_classifier_free_guidance(negative: str) -> None:
    uncond, cond = torch.tensor([[1.0, 0, 1.5]]), torch.tensor([[1.0, 1.0, 1.0]])
    ids = torch.tensor([[0]])
    kwargs = {"explicit_with_mask": dict(negative_prompt_ids=ids, negative_prompt_attention_mask=torch.ones_like(ids)),
              "explicit": dict(negative_prompt_ids=ids), "implicit": {}}[negative]
    out = ClassifierFreeGuidance(1.5, _FixedLogitsModel(uncond), 4, **kwargs)(ids, cond)
    lsm = lambda x: x.log_softmax(-1)  # noqa: E731
    torch.testing.assert_close(out, lsm(uncond) + 1.5 * (lsm(cond) - lsm(uncond)))


def test_watermark_greenlist_is_transformers() -> None:
    ids = ids_tensor((3, 5), 20)
    ids[:, -1] = 10
    scores = uniform(3, 20)
    out = Watermark(20)(ids, scores)
    assert (out[:, 1] == scores[:, 1] + 2.0).all()  # transformers' expected green id for last token 10 on CPU
    with pytest.raises(GenerationConfigError):
        Watermark(20, dict(seeding_scheme="hash"))
    with pytest.raises(GenerationConfigError):
        Watermark(20, dict(greenlist_ratio=1.2))


# ---- every processor: pure (inputs untouched) and validated at construction --------------------------------
PROCESSORS = [
    RepetitionPenalty(1.5), RepetitionPenalty(0.5, torch.tensor([1, 0])), EncoderRepetitionPenalty(2.0, torch.tensor([[1, 2], [3, 4]])),
    PresencePenalty(0.5, 2), FrequencyPenalty(-0.5, 2), LogitBias({"3": -100, 4: 5.5}), SequenceBias({(1, 2): 1.0}),
    NoBadWords([[1], [2, 3]]), NoRepeatNGram(2), EncoderNoRepeatNGram(2, torch.tensor([[1, 2], [3, 4]])),
    MinLength(10, 2), MinNewTokens(2, 5, [2, 3]), PrefixConstrained(lambda b, ids: [1, 2, 3]), ForcedBOS(1),
    ForcedEOS(5, 2), RemoveInvalidValues(), ExponentialDecayLengthPenalty((1, 1.5), 2, 2), SuppressTokens([1, 2]),
    SuppressTokensAtBegin([1], 4), LogitNormalization(), Temperature(0.5), TopK(3), TopP(0.5), MinP(0.1), TopH(0.5),
    Typical(0.5), Epsilon(0.05), Eta(0.05), DRY(0.8, 1.75, 2, 0, [7]), XTC(0.05, 1.0, seed=0), TopNSigma(1.0),
    Watermark(20), Watermark(20, dict(seeding_scheme="selfhash")),
    ClassifierFreeGuidance(1.5, _FixedLogitsModel(torch.randn(1, 20)), 4),
]


@pytest.mark.parametrize("proc", PROCESSORS, ids=lambda p: type(p).__name__)
def test_processor_never_modifies_its_input(proc) -> None:
    # lengths 1, 4 and 6 reach the branches that fire at a given length (forced BOS/EOS, begin suppression)
    for length in (1, 4, 6):
        ids = torch.tensor([[1, 2, 3, 1, 2, 9], [4, 3, 4, 3, 5, 4]])[:, :length]
        scores = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
        scores[0, 5] = -INF
        ids_before, scores_before = ids.clone(), scores.clone()
        out = proc(ids, scores)
        assert out.shape == scores.shape
        assert torch.equal(ids, ids_before)
        assert torch.equal(scores, scores_before)


def test_mirostat_never_modifies_its_input() -> None:
    from nexttoken.generation.processors.llamacpp import MirostatV2

    scores = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    before = scores.clone()
    m = MirostatV2(3.0, 0.1, seed=0)
    m.truncate(scores)
    m(scores)
    assert torch.equal(scores, before)


BAD = [
    (RepetitionPenalty, (0.0,)), (RepetitionPenalty, (-1.0,)), (EncoderRepetitionPenalty, (0, torch.zeros(1, 1))),
    (PresencePenalty, (2.5, 0)), (FrequencyPenalty, ("1", 0)), (LogitBias, ({"x": 1},)), (LogitBias, ({1: 101},)),
    (SequenceBias, ({},)), (SequenceBias, ([[[1], "a"]],)), (NoBadWords, ([],)), (NoBadWords, ([[-1]],)),
    (NoRepeatNGram, (0,)), (MinLength, (-1, 2)), (MinNewTokens, (0, -2, 2)), (ForcedEOS, (5, -1)),
    (ExponentialDecayLengthPenalty, ((1,), 2, 0)), (SuppressTokens, (["a"],)), (Temperature, (0.0,)), (TopK, (0,)),
    (TopP, (1.5,)), (MinP, (-0.1,)), (TopH, (0.0,)), (Typical, (1.0,)), (Epsilon, (1.0,)), (Eta, (0.0,)),
    (DRY, (-1.0,)), (DRY, (1.0, 0.5)), (DRY, (1.0, 1.75, 0)), (XTC, (0.1, 1.5)), (TopNSigma, (-1.0,)),
    (PrefixConstrained, (None,)),
]


@pytest.mark.parametrize("cls,args", BAD, ids=lambda x: getattr(x, "__name__", repr(x))[:30])
def test_processor_rejects_bad_arguments(cls, args) -> None:
    with pytest.raises(GenerationConfigError):
        cls(*args)
