import math
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ksana.kernels.backends import cpu_ops
from ksana.sampling_params import SamplingParams
from ksana.worker.sampler import Sampler, SamplingRow, fast_argmax, generator_seed

VOCAB = 64


def row(seed: int = 0, num_output_tokens: int = 0, prompt=(), output=(), banned=(), **params) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        seed=seed,
        num_output_tokens=num_output_tokens,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        banned_token_ids=list(banned),
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


sampler = Sampler()


def test_greedy_equals_argmax_batched_and_alone():
    logits = random_logits(8)
    expected = logits.argmax(dim=-1).tolist()
    out = sampler(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == expected
    for i in range(8):
        assert sampler(logits[i : i + 1], [row(temperature=0.0)]).token_ids == [expected[i]]


def test_greedy_ties_pick_first_index():
    logits = torch.zeros(1, VOCAB)
    logits[0, [5, 9, 40]] = 2.0
    assert sampler(logits, [row(temperature=0.0)]).token_ids == [5]


def test_top_k_1_is_greedy_even_at_temperature_1():
    logits = random_logits(16, seed=1)
    out = sampler(logits, [row(seed=i, temperature=1.0, top_k=1) for i in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_same_seed_and_step_gives_same_token_alone_and_in_any_batch_order():
    logits = random_logits(6, seed=2)
    rows = [row(seed=100 + i, num_output_tokens=7 + i, temperature=1.0) for i in range(6)]
    alone = [sampler(logits[i : i + 1], [rows[i]]).token_ids[0] for i in range(6)]
    assert sampler(logits, rows).token_ids == alone
    order = [3, 0, 5, 1, 4, 2]
    shuffled = sampler(logits[order], [rows[i] for i in order]).token_ids
    assert shuffled == [alone[i] for i in order]
    # Mixed with greedy and penalised neighbours, the draw is still the same.
    mixed_rows = [
        row(temperature=0.0),
        rows[2],
        row(seed=1, temperature=0.7, repetition_penalty=1.3, prompt=[1]),
    ]
    mixed_logits = torch.stack([logits[0], logits[2], logits[4]])
    assert sampler(mixed_logits, mixed_rows).token_ids[1] == alone[2]


def test_generator_seed_is_stable_and_distinguishes_steps():
    assert generator_seed(1234, 5) == generator_seed(1234, 5)
    assert generator_seed(1234, 5) != generator_seed(1234, 6)
    assert generator_seed(1234, 5) != generator_seed(1235, 5)
    assert 0 <= generator_seed(-3, 10**12) < 2**63
    # Pinned: a process-salted hash would change this value from run to run.
    assert generator_seed(0, 0) == int.from_bytes(
        __import__("hashlib").blake2b(b"0:0", digest_size=8).digest(), "little"
    ) & ((1 << 63) - 1)


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1, VOCAB)  # uniform: any fixed draw would be a bug
    draws_by_seed = [
        tuple(
            sampler(logits, [row(seed=s, num_output_tokens=n, temperature=1.0)]).token_ids[0]
            for n in range(20)
        )
        for s in range(10)
    ]
    assert len(set(draws_by_seed)) == 10
    all_tokens = [t for draws in draws_by_seed for t in draws]
    assert len(set(all_tokens)) > VOCAB // 2


def test_top_k_never_picks_excluded():
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0) * 0.05  # nearly flat, top 5 are 59..63
    picked = {sampler(logits, [row(seed=s, temperature=1.0, top_k=5)]).token_ids[0] for s in range(300)}
    assert picked == set(range(VOCAB - 5, VOCAB))


def test_top_p_never_picks_excluded():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    # Smallest set reaching 0.7 is {0, 1}; at 0.85 it is {0, 1, 2}.
    picked = {sampler(logits, [row(seed=s, temperature=1.0, top_p=0.7)]).token_ids[0] for s in range(300)}
    assert picked == {0, 1}
    picked = {sampler(logits, [row(seed=s, temperature=1.0, top_p=0.85)]).token_ids[0] for s in range(300)}
    assert picked == {0, 1, 2}


def test_min_p_never_picks_excluded():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().unsqueeze(0)
    # min_p 0.3 -> threshold 0.12: keeps {0, 1, 2}.
    picked = {sampler(logits, [row(seed=s, temperature=1.0, min_p=0.3)]).token_ids[0] for s in range(300)}
    assert picked == {0, 1, 2}


def test_top_k_top_p_and_batch_of_mixed_settings():
    logits = random_logits(3, seed=5)
    for step in range(100):
        rows = [
            row(seed=1, num_output_tokens=step, temperature=1.0, top_k=3),
            row(seed=2, num_output_tokens=step, temperature=0.5, top_p=0.5),
            row(seed=3, num_output_tokens=step, temperature=0.0),
        ]
        out = sampler(logits, rows)
        assert out.token_ids[0] in logits[0].topk(3).indices.tolist()
        sorted_probs, sorted_ids = (logits[1] / 0.5).softmax(-1).sort(descending=True)
        nucleus = int((sorted_probs.cumsum(0) < 0.5).sum()) + 1
        assert out.token_ids[1] in sorted_ids[:nucleus].tolist()
        assert out.token_ids[2] == int(logits[2].argmax())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    expected = (logits[0] / temperature).softmax(-1)
    num_draws = 2000
    counts = Counter(
        sampler(logits, [row(seed=123, num_output_tokens=n, temperature=temperature)]).token_ids[0]
        for n in range(num_draws)
    )
    for token, p in enumerate(expected.tolist()):
        # 4.5 standard deviations of a binomial frequency; deterministic given the seeds.
        tolerance = 4.5 * math.sqrt(p * (1 - p) / num_draws)
        assert abs(counts[token] / num_draws - p) < tolerance, (token, counts[token], p)


def test_repetition_penalty_matches_hf():
    logits = random_logits(1, seed=6)
    logits[0, 3] = -2.0  # a negative logit on a repeated token: multiplied
    logits[0, 4] = 10.0  # the raw argmax, repeated: divided, so token 20 wins
    logits[0, 20] = 9.0
    prompt, output, penalty = [3, 4, 4, 10], [11, 3], 1.7
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    out = sampler(logits, [row(temperature=0.0, repetition_penalty=penalty, prompt=prompt, output=output)])
    assert out.token_ids == hf.argmax(dim=-1).tolist() == [20]


def test_repetition_penalty_processed_logits_equal_hf():
    from ksana.worker.sampler import _apply_repetition_penalty

    logits = random_logits(2, seed=7)
    rows = [
        row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 2, 5], output=[7, 1]),
        row(temperature=0.0, repetition_penalty=0.6, prompt=[9, 8], output=[8, 30]),
    ]
    ours = logits.clone()
    _apply_repetition_penalty(ours, rows)
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)])
        hf = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], hf, rtol=0, atol=0)


def test_presence_and_frequency_penalties_exact():
    from ksana.worker.sampler import _apply_presence_frequency_penalties

    logits = torch.zeros(1, 8)
    r = row(
        temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, prompt=[6, 6, 6], output=[2, 2, 2, 5]
    )
    _apply_presence_frequency_penalties(logits, [r])
    expected = torch.zeros(1, 8)
    expected[0, 2] = -(0.5 + 3 * 0.25)
    expected[0, 5] = -(0.5 + 0.25)  # token 6 is only in the prompt: untouched (OpenAI semantics)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)

    # Through the sampler: token 2 would win greedily, but the penalties push it below token 3.
    logits = torch.zeros(1, 8)
    logits[0, 2] = 1.5
    logits[0, 3] = 0.4
    assert sampler(logits, [row(temperature=0.0)]).token_ids == [2]
    assert sampler(logits, [r]).token_ids == [3]
    # A negative frequency penalty rewards repetition.
    logits[0, 2] = 0.0
    assert sampler(logits, [row(temperature=0.0, frequency_penalty=-1.0, output=[2])]).token_ids == [2]


def test_banned_tokens_never_chosen():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 20.0
    logits[0, 8] = 19.0
    assert sampler(logits, [row(temperature=0.0, banned=[7])]).token_ids == [8]
    banned = set(range(0, VOCAB, 2))
    flat = torch.zeros(1, VOCAB)
    picked = {
        sampler(flat, [row(seed=s, temperature=1.0, banned=sorted(banned))]).token_ids[0] for s in range(300)
    }
    assert picked and not picked & banned


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(4, seed=8)
    rows = [
        row(temperature=0.0),
        row(seed=1, temperature=0.3, top_k=2, repetition_penalty=2.0, prompt=[0, 1, 2]),
        row(temperature=0.0, banned=[int(logits[2].argmax())]),
        row(seed=2, temperature=1.5, top_p=0.5),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    expected = [raw[i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == expected
    assert out.token_ids[2] != int(logits[2].argmax())


def test_top_logprobs_sorted_and_correct():
    logits = random_logits(3, seed=9)
    rows = [row(temperature=0.0, logprobs=5), row(temperature=0.0), row(seed=4, temperature=1.0, logprobs=0)]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    top = out.top_logprobs[0]
    assert len(top) == 5
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == values.tolist()
    assert top[0] == (out.token_ids[0], out.logprobs[0])
    assert out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, VOCAB), [row()])


@pytest.mark.parametrize("vocab", [1024, 1500, 2176, 4096, 32000, 49152, 50257, 151936])
def test_fast_argmax_equals_argmax_on_random_rows(vocab):
    """Chunks of 1024 (4096, 49152), 256 (32000) and 128 (2176, 151936); 1024 and the odd sizes fall back."""
    logits = random_logits(16, vocab=vocab, seed=vocab)
    assert torch.equal(fast_argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [3072, 4096, 3200])
def test_fast_argmax_ties_pick_the_first_index_within_and_across_chunks(vocab):
    logits = torch.zeros(6, vocab)
    logits[0, [5, 9, 2000]] = 2.0  # the first chunk holds two, a later chunk one
    logits[1, [1030, 1031, 2999]] = 1.0  # none in the first chunk
    logits[2, [2999]] = 7.0
    logits[3, [vocab - 2, vocab - 1]] = 3.0
    logits[4] = torch.randint(0, 3, (vocab,), generator=torch.Generator().manual_seed(1)).float()  # many ties
    # row 5: all equal, so index 0
    assert fast_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert fast_argmax(logits).tolist()[:4] == [5, 1030, 2999, vocab - 2]


def test_fast_argmax_nan_and_minus_inf_rows_as_torch():
    logits = random_logits(5, vocab=5120, seed=3)
    logits[0, 4321] = float("nan")
    logits[4, [700, 4000]] = float("nan")  # the first NaN wins, as in torch
    logits[1] = float("-inf")
    logits[2, 100:200] = float("inf")
    assert torch.equal(fast_argmax(logits), logits.argmax(dim=-1))
    assert fast_argmax(logits)[0].item() == 4321


def test_greedy_batch_over_a_large_vocab_matches_argmax_and_log_softmax():
    logits = random_logits(16, vocab=49152, seed=4)
    out = sampler(logits, [row(temperature=0.0) for _ in range(16)])
    expected = logits.argmax(dim=-1)
    assert out.token_ids == expected.tolist()
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == raw.gather(1, expected.unsqueeze(1)).squeeze(1).tolist()


# ---- the native greedy fast path (kernels/cpu: argmax and the chosen logprob in one pass) ------------------------
fast_sampler = Sampler(cpu_ops().greedy_logprobs)


def test_native_greedy_path_is_there():
    assert fast_sampler.greedy_logprobs is not None  # the C kernels build on the test machine


@pytest.mark.parametrize("vocab", [5, 1003, 49152])
def test_native_greedy_matches_argmax_and_log_softmax(vocab: int):
    """Vocabularies under one vector, with a tail, and smollm2's; ties keep the first maximum."""
    logits = random_logits(16, vocab=vocab, seed=vocab)
    logits[3, vocab // 2] = logits[3, vocab - 1] = logits[3].max() + 1  # a tie: the first index wins
    out = fast_sampler(logits, [row(temperature=0.0) for _ in range(16)])
    expected = logits.argmax(dim=-1)
    assert out.token_ids == expected.tolist()
    assert out.token_ids[3] == vocab // 2
    raw = torch.log_softmax(logits, dim=-1).gather(1, expected.unsqueeze(1)).squeeze(1)
    assert out.logprobs == pytest.approx(raw.tolist(), abs=1e-5)  # its own exp and summation order
    assert out.top_logprobs == [None] * 16


def test_native_greedy_special_values_follow_torch():
    logits = random_logits(5, vocab=1000, seed=3)
    logits[0, 700] = float("nan")  # NaN counts as the maximum, log_softmax is NaN
    logits[0, 900] = float("nan")
    logits[1] = float("-inf")  # argmax 0, log_softmax NaN
    logits[2, 10] = logits[2, 20] = float("inf")  # the first +inf, log_softmax NaN
    logits[3, :999] = float("-inf")  # one finite value: logprob 0
    out = fast_sampler(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(dim=-1).tolist() == [700, 0, 10, 999, out.token_ids[4]]
    raw = torch.log_softmax(logits, dim=-1)
    assert [math.isnan(lp) for lp in out.logprobs] == [True, True, True, False, False]
    assert out.logprobs[3] == 0.0 and out.logprobs[4] == pytest.approx(raw[4, out.token_ids[4]].item(), abs=1e-5)


def test_rows_asking_more_than_greedy_take_the_exact_path():
    """Top logprobs or a processed row anywhere in the batch: the whole step goes through log_softmax."""
    logits = random_logits(3, vocab=1000, seed=5)
    raw = torch.log_softmax(logits, dim=-1)
    for rows in ([row(temperature=0.0), row(temperature=0.0, logprobs=2), row(temperature=0.0)],
                 [row(temperature=0.0), row(temperature=0.0, repetition_penalty=1.3, prompt=[1]), row(temperature=0.0)]):
        out = fast_sampler(logits, rows)
        assert out.logprobs == [raw[i, t].item() for i, t in enumerate(out.token_ids)]  # exactly torch's


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> dict[int, float]:
    """HF's top-p set of one row and each member's share of it."""
    probs, ids = (logits / temperature).softmax(-1).sort(descending=True)
    size = int((probs.cumsum(0) - probs < top_p).sum())
    kept = probs[:size] / probs[:size].sum()
    return dict(zip(ids[:size].tolist(), kept.tolist(), strict=True))


def test_top_p_on_a_large_vocabulary_draws_each_nucleus_token_at_its_share(monkeypatch):
    """A sharp row over 1,000 tokens: its nucleus lies among the highest logits, so the full sort never runs, and
    the draws follow the nucleus's renormalised probabilities."""
    import ksana.worker.sampler as sampler_module

    def no_sort(*args):
        raise AssertionError("the full sort ran")

    monkeypatch.setattr(sampler_module, "_truncated_probs", no_sort)
    logits = torch.full((1, 1000), -5.0)
    logits[0, [7, 500, 999, 31, 64]] = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5])
    expected = _nucleus(logits[0], 0.7, 0.9)
    assert 2 <= len(expected) < 5
    num_draws = 3000
    counts = Counter(sampler(logits, [row(seed=9, num_output_tokens=n, temperature=0.7, top_p=0.9)]).token_ids[0]
                     for n in range(num_draws))
    assert set(counts) <= set(expected)
    for token, p in expected.items():
        assert abs(counts[token] / num_draws - p) < 4.5 * math.sqrt(p * (1 - p) / num_draws), (token, counts, p)


def test_a_nucleus_wider_than_the_candidates_takes_the_full_sort(monkeypatch):
    import ksana.worker.sampler as sampler_module

    calls = []
    full_sort = sampler_module._truncated_probs
    monkeypatch.setattr(sampler_module, "_truncated_probs", lambda x, rows: calls.append(len(rows)) or full_sort(x, rows))
    logits = torch.linspace(0.0, 0.5, 1000).unsqueeze(0)  # nearly flat: p = 0.5 takes about 450 tokens
    expected = _nucleus(logits[0], 1.0, 0.5)
    assert len(expected) > sampler_module.NUCLEUS_CANDIDATES
    picked = {sampler(logits, [row(seed=s, temperature=1.0, top_p=0.5)]).token_ids[0] for s in range(200)}
    assert picked <= set(expected) and len(picked) > 50
    assert calls == [1] * 200


def test_nucleus_rows_and_others_in_one_batch_keep_their_own_rules():
    logits = random_logits(4, vocab=2000, seed=3)
    for step in range(50):
        rows = [row(seed=1, num_output_tokens=step, temperature=0.3, top_p=0.8),
                row(seed=2, num_output_tokens=step, temperature=1.0, top_k=4),
                row(seed=3, num_output_tokens=step, temperature=0.0),
                row(seed=4, num_output_tokens=step, temperature=2.0, top_p=0.95)]
        out = sampler(logits, rows)
        assert out.token_ids[0] in _nucleus(logits[0], 0.3, 0.8)
        assert out.token_ids[1] in logits[1].topk(4).indices.tolist()
        assert out.token_ids[2] == int(logits[2].argmax())
        assert out.token_ids[3] in _nucleus(logits[3], 2.0, 0.95)
