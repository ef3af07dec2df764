import pytest
import torch
from hyspec_spec_workers.sampling import (
    NoiseKey,
    Sampler,
    SamplingTensors,
    filtered_probs,
    keyed_exponential,
    token_logprobs,
)

CPU = torch.device("cpu")


def _st(
    n: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    keys: list[NoiseKey | None] | None = None,
    num_logprobs: int = -1,
) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[temperature] * n,
        top_k=[top_k] * n,
        top_p=[top_p] * n,
        min_p=[min_p] * n,
        keys=keys if keys is not None else [None] * n,
        num_logprobs=num_logprobs,
        device=CPU,
    )


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_temperature_zero_is_argmax_even_with_filters() -> None:
    logits = torch.randn(5, 50, generator=_gen(0))
    out = Sampler(CPU)(logits, _st(5, temperature=0.0, top_k=3, top_p=0.5, min_p=0.2))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_fast_path_equals_the_sampler() -> None:
    """`Sampler.greedy` (no sampling tensors built) gives what the full path gives for all-greedy rows, and
    `all_greedy` is known on the host (fp32 semantics) without reading the device tensor."""
    logits = torch.randn(6, 40, generator=_gen(7))
    st = _st(6, temperature=0.0)
    assert st.greedy_hint is True and st.all_greedy
    sampler = Sampler(CPU)
    full, fast = sampler(logits, st), sampler.greedy(logits)
    assert torch.equal(fast.token_ids, full.token_ids)
    assert fast.logprobs is None and fast.top_ids is None and fast.top_logprobs is None
    assert _st(2, temperature=1e-50).all_greedy  # 0 in fp32, as the device comparison would say
    assert not _st(2, temperature=0.5).all_greedy
    with pytest.raises(ValueError, match="logits"):
        sampler.greedy(logits[0])


def test_greedy_takes_float64_logits() -> None:
    """The sampler took any float dtype before its argmax went through `argmax_rows` (torch.argmax's answer,
    fp64 compared in fp64): 1 + 1e-12 beats 1, which fp32 would round to a tie won by the first."""
    logits = torch.zeros(2, 30, dtype=torch.float64)
    logits[:, 4], logits[:, 17] = 1.0, 1.0 + 1e-12
    logits[1, 25] = 1e300  # +inf in fp32
    sampler = Sampler(CPU)
    assert sampler.greedy(logits).token_ids.tolist() == [17, 25]
    assert sampler(logits, _st(2, temperature=0.0)).token_ids.tolist() == [17, 25]


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(4, 30, generator=_gen(1))
    st = SamplingTensors.build(
        temperature=[0.0, 1.0, 0.0, 2.0],
        top_k=[-1] * 4,
        top_p=[1.0] * 4,
        min_p=[0.0] * 4,
        keys=[None] * 4,
        num_logprobs=-1,
        device=CPU,
    )
    out = Sampler(CPU)(logits, st)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_top_k_mask() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 2.0]])
    p = filtered_probs(logits, _st(1, top_k=3))
    assert (p[0] > 0).tolist() == [False, True, False, True, True, False]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))
    # k = 0 and k = -1 keep everything
    assert bool((filtered_probs(logits, _st(1, top_k=0)) > 0).all())


def test_top_k_keeps_tokens_tied_with_the_kth() -> None:
    # vLLM v1 masks logits below the k-th largest: a token tied with it stays
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert (filtered_probs(logits, _st(1, top_k=2))[0] > 0).tolist() == [True, False, True, True, False]
    assert (filtered_probs(logits, _st(1, top_k=9))[0] > 0).all()  # k past the vocabulary keeps all


def test_top_p_mask_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert (filtered_probs(logits, _st(1, top_p=0.8))[0] > 0).tolist() == [True, True, False, False]
    assert (filtered_probs(logits, _st(1, top_p=0.81))[0] > 0).tolist() == [True, True, True, False]
    # the most likely token always survives
    assert (filtered_probs(logits, _st(1, top_p=0.01))[0] > 0).tolist() == [True, False, False, False]


def test_min_p_comes_before_top_p_as_vllm_v1() -> None:
    """vLLM v1 filters min-p first, then top-k and top-p on what is left (renormalised): with min_p 0.2 the
    0.05 token goes, the rest is [0.526, 0.316, 0.158], whose third token starts past top_p 0.83 (0.842);
    top-p over the unfiltered [0.5, 0.3, 0.15, 0.05] would have kept it (0.8 before it)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    p = filtered_probs(logits, _st(1, top_p=0.83, min_p=0.2))
    assert (p[0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(p[0, :2], torch.tensor([0.625, 0.375]))


def test_top_p_one_keeps_every_token_of_a_large_vocabulary() -> None:
    """top_p = 1 is off (vLLM skips the filter): in fp32 the cumulative mass of a 152k vocabulary reaches 1
    well before its tail, and the tail (thousands of tokens of positive probability) must not be cut."""
    logits = torch.randn(2, 151936, generator=_gen(0)) * 3
    assert bool((torch.softmax(logits, dim=-1) > 0).all())
    p = filtered_probs(logits, _st(2, top_p=1.0))
    assert int((p == 0).sum()) == 0
    torch.testing.assert_close(p, torch.softmax(logits, dim=-1))


def test_min_p_mask_relative_to_top() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    p = filtered_probs(probs.log(), _st(1, min_p=0.45))
    assert (p[0] > 0).tolist() == [False, True, True, True]
    torch.testing.assert_close(p[0, 1:], torch.tensor([0.4, 0.3, 0.2]) / 0.9)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    cold = filtered_probs(logits, _st(1, temperature=0.1))
    hot = filtered_probs(logits, _st(1, temperature=10.0))
    assert cold[0, 2] > 0.99 and hot[0, 2] < 0.4


def test_sampled_frequencies_follow_filtered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4000, 1)
    st = _st(4000, top_k=3, temperature=0.7)
    out = Sampler(CPU, seed=3)(logits, st)
    freq = torch.bincount(out.token_ids, minlength=5).float() / 4000
    want = filtered_probs(logits[:1], _st(1, top_k=3, temperature=0.7))[0]
    assert freq[3] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, want, atol=0.03, rtol=0)


def test_seed_gives_same_tokens_whatever_the_batch() -> None:
    """A seeded row's draw is a function of (seed, position): the batch around it and the sampler's shared
    generator change nothing; another position or seed draws anew."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    sampler_a, sampler_b = Sampler(CPU, seed=1), Sampler(CPU, seed=2)
    a, b = [], []
    for pos in range(8):
        a.append(int(sampler_a(logits[2:3], _st(1, keys=[(42, pos)])).token_ids[0]))
        keys: list[NoiseKey | None] = [None, None, (42, pos), None, (7, pos), None]
        b.append(int(sampler_b(logits, _st(6, keys=keys)).token_ids[2]))
    assert a == b
    assert len(set(a)) > 1  # it really samples
    c = [int(Sampler(CPU)(logits[2:3], _st(1, keys=[(43, pos)])).token_ids[0]) for pos in range(8)]
    assert c != a  # another seed, another sequence
    again = [
        int(Sampler(CPU, seed=9)(logits[2:3], _st(1, keys=[(42, pos)])).token_ids[0]) for pos in range(8)
    ]
    assert again == a


def test_keyed_noise_is_exponential_and_independent() -> None:
    """Keyed noise over many (seed, position) keys: mean and variance of Exp(1), no correlation between
    neighbouring positions or tokens, and draws that follow the distribution (chi-square)."""
    seeds = torch.arange(2000, dtype=torch.int64) * 7919 - 10**12  # negative seeds too
    pos = torch.arange(2000, dtype=torch.int64) % 37
    e = keyed_exponential(seeds, pos, 64)  # [2000, 64]
    assert (e > 0).all()
    assert abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.var()) - 1.0) < 0.05
    nxt = keyed_exponential(seeds, pos + 1, 64)
    corr = torch.corrcoef(torch.stack([e.flatten(), nxt.flatten()]))[0, 1]
    assert abs(float(corr)) < 0.02
    corr_tok = torch.corrcoef(torch.stack([e[:, :-1].flatten(), e[:, 1:].flatten()]))[0, 1]
    assert abs(float(corr_tok)) < 0.02
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    draws = torch.argmax(p / keyed_exponential(seeds, pos, 5), dim=-1)
    freq = torch.bincount(draws, minlength=5).float()
    chi2 = float(((freq - 2000 * p) ** 2 / (2000 * p)).sum())
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001
    # pairs of positions of one seed: joint frequencies are the product (no structure across positions)
    a = torch.argmax(p / keyed_exponential(seeds, pos, 5), dim=-1)
    b = torch.argmax(p / keyed_exponential(seeds, pos + 1000, 5), dim=-1)
    joint = torch.bincount(a * 5 + b, minlength=25).float().reshape(5, 5)
    want = 2000 * p[:, None] * p[None, :]
    chi2_joint = float(((joint - want) ** 2 / want).sum())
    assert chi2_joint < 45  # 16 degrees of freedom: p < 0.001


def test_logprobs_of_chosen_and_top() -> None:
    logits = torch.randn(3, 20, generator=_gen(5))
    out = Sampler(CPU)(logits, _st(3, temperature=0.0, num_logprobs=2))
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids.shape == (3, 2) and torch.equal(out.top_ids[:, 0], out.token_ids)
    assert Sampler(CPU)(logits, _st(3, temperature=0.0)).logprobs is None


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler(CPU)(torch.zeros(2, 5), _st(3))
    with pytest.raises(ValueError, match="keys"):
        SamplingTensors.build(
            temperature=[1.0], top_k=[1], top_p=[1.0], min_p=[0.0], keys=[], num_logprobs=-1, device=CPU
        )


def test_token_logprobs_against_the_definition() -> None:
    """The one logprob helper: log-softmax of the raw logits in fp32 (bf16 input too), ranks as vLLM v1 counts
    them (tokens at least as likely, itself included: ties share the worse rank), and the top tokens in
    order; none asked, none computed."""
    logits = torch.tensor([[2.0, 1.0, 2.0, -1.0], [0.0, 0.5, 0.25, 3.0]], dtype=torch.bfloat16)
    chosen = torch.tensor([2, 1])
    got = token_logprobs(logits, chosen, 2)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert got.logprobs.dtype == torch.float32
    assert torch.equal(got.logprobs, ref[[0, 1], [2, 1]])
    assert got.ranks.tolist() == [2, 2]  # row 0: tied with token 0 for the top; row 1: below token 3 only
    assert got.top_ids is not None and got.top_logprobs is not None
    assert got.top_ids[1].tolist() == [3, 1] and torch.equal(got.top_logprobs, ref.topk(2, dim=-1).values)
    none = token_logprobs(logits, chosen, 0)
    assert none.top_ids is None and none.top_logprobs is None and torch.equal(none.ranks, got.ranks)
    assert token_logprobs(logits, chosen, 9).top_ids.shape == (2, 4)  # type: ignore[union-attr]
