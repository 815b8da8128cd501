"""Adaptive speculation (verispec.speculation): the cost model's arithmetic, the choice of k, and that
choosing k from the past never changes the law of what is emitted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import beta

from stats import chisquare_pvalue
from streams import joint_law
from test_decode_toy import V, as_vector, law_fn, toy_pair
from verispec.decode import BatchDecoder, DecodeConfig, decode_prompts, position_costs
from verispec.models import ModelDrafter, load_drafter, load_model
from verispec.sampling import SamplingConfig
from verispec.speculation import (AdaptivePolicy, Costs, RowAcceptance, expected_tokens, measure_costs,
                                  row_seconds_per_token)

# hand-made costs (seconds): at batch 1 a wider pass costs a little more and drafts are cheap, so the
# best k grows with the acceptance; from batch 4 on a wide pass is expensive and speculation cannot pay
COSTS = Costs(target={1: (1.0, 1.2, 1.4), 4: (1.0, 3.0, 5.0)}, draft={1: 0.1, 4: 0.1})


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.0, 0.3, 0.75, 1.0):
        for k in range(5):
            assert expected_tokens(a, k) == pytest.approx(sum(a**j for j in range(k + 1)))


def test_the_best_k_grows_with_the_acceptance():
    policy = AdaptivePolicy(COSTS, k_max=2)
    assert [policy.choose_k(a) for a in (0.1, 0.5, 0.95)] == [0, 1, 2]
    # per token at a = 0.5: k=0 costs 1.0, k=1 (0.1 + 1.2) / 1.5 = 0.867, k=2 (0.2 + 1.4) / 1.75 = 0.914
    assert policy.choose_k(0.5) == 1
    assert policy.pays([0.5], [1])  # batch 1: the row's own choice (1.5 tokens per 1.3 s beat 1 per 1.0 s)
    assert not policy.pays([0.9] * 4, [2] * 4)  # batch 4: 4 * 2.71 tokens per 5.2 s < 4 per 1.0 s


def test_a_row_explores_before_it_stops_drafting():
    """k = 0 forever would never learn the row's acceptance: below `explore` tests a row drafts, at the k
    that pays best if every draft is accepted (here 2: 1.6 s for 3 tokens against 1.3 s for 2)."""
    policy = AdaptivePolicy(COSTS, k_max=2, explore=8)
    assert policy.explore_k == 2
    assert policy.choose_k(0.1) == 0
    assert policy.choose_k(0.1, tests=3) == 2 and policy.choose_k(0.1, tests=8) == 0
    assert policy.choose_k(0.95, tests=0) == 2  # exploring never lowers a choice
    hopeless = AdaptivePolicy(Costs(target={1: (1.0, 2.5, 4.0)}, draft={1: 0.5}), k_max=2)
    assert not hopeless.can_pay and hopeless.choose_k(0.5, tests=0) == 0  # nothing could pay: no exploring


def test_exploring_stops_once_paying_is_implausible():
    """The break-even acceptance, and the posterior chance of reaching it, Beta(accepted + 1, rejected + 1)
    as scipy computes it; a row whose tests make paying implausible stops exploring early."""
    # a wide pass is dear: only a high acceptance pays (per token at a: (2 * 0.2 + 2.2) / E(a, 2) < 1)
    dear = AdaptivePolicy(Costs(target={1: (1.0, 1.9, 2.2)}, draft={1: 0.2}), k_max=2, explore=8)
    a = dear.break_even
    assert 0.8 < a < 1.0 and (2 * 0.2 + 2.2) / expected_tokens(a, 2) == pytest.approx(1.0, abs=1e-9)
    for accepted, tests in ((0, 0), (0, 3), (2, 4), (5, 5), (7, 7)):
        posterior = beta(accepted + 1, tests - accepted + 1)
        assert dear.chance_to_pay(accepted, tests) == pytest.approx(posterior.sf(a))
    assert dear.choose_k(0.5, tests=0, accepted=0) == dear.explore_k == 2  # nothing known yet: explore
    assert dear.chance_to_pay(1, 3) < 0.05 and dear.choose_k(0.4, tests=3, accepted=1) == 0  # stops early
    assert dear.choose_k(0.9, tests=3, accepted=3) == 2  # still plausible: goes on exploring


def test_acceptance_counts_tests_not_drafts():
    seen = RowAcceptance()
    seen.update(proposed=4, accepted=1)  # accepted one, rejected the second: 2 tests, 3rd and 4th untested
    seen.update(proposed=2, accepted=2)  # both accepted: 2 tests
    assert (seen.accepted, seen.tests) == (3, 4)
    assert seen.estimate == pytest.approx(4 / 6)


def test_bad_costs_and_policies_are_refused():
    with pytest.raises(ValueError, match="positive and finite"):
        Costs(target={1: (1.0, float("nan"))}, draft={1: 0.1})
    with pytest.raises(ValueError, match="same batch sizes"):
        Costs(target={1: (1.0, 1.2)}, draft={2: 0.1})
    with pytest.raises(ValueError, match="k_max must be between 1 and the measured 2"):
        AdaptivePolicy(COSTS, k_max=3)


def adaptive_counts(rule: str, policy: AdaptivePolicy, runs: int, length: int) -> tuple[np.ndarray, list]:
    target, draft = toy_pair()
    config = DecodeConfig(k=2, max_new_tokens=length, diagnostics=False, policy=policy)
    gens = decode_prompts(target, [[1]] * runs, [torch.Generator().manual_seed(i) for i in range(runs)],
                          config, ModelDrafter(draft), rule, batch_size=500)
    counts = np.zeros(V**length)
    for g in gens:
        counts[int(np.ravel_multi_index(g.token_ids, (V,) * length))] += 1
    return counts, gens


@pytest.mark.slow
def test_choosing_k_from_the_past_keeps_a_lossless_rule_exact():
    """k depends on the row's own acceptances so far, i.e. on the past only, so each block is still a
    lossless block given its prefix: 3-token sequences follow the target's law (chi-square, 2000 rows).
    Power: the same sampler with a lossy rule is told apart from the target at the same threshold."""
    target, _ = toy_pair()
    truth = as_vector(joint_law(law_fn(target, [1]), V, 3), 3)
    policy = AdaptivePolicy(COSTS, k_max=2, by_batch=False, explore=0)  # rows of 3 tokens: no exploring
    counts, gens = adaptive_counts("lossless", policy, 2000, 3)
    chosen = {k for g in gens for k in g.speculation["k_per_block"]}
    assert {0, 1, 2} <= chosen  # the policy did vary k
    assert chisquare_pvalue(counts, truth) > 1e-4
    lossy, _ = adaptive_counts("lenience:l=0.3", policy, 2000, 3)
    assert chisquare_pvalue(lossy, truth) < 1e-4


def test_speculation_off_by_batch_is_plain_decoding_token_for_token():
    """Where speculation cannot pay at the batch's size, every block drafts nothing and draws one token
    from the target with one uniform: exactly plain decoding's draws, so the same tokens."""
    target, draft = toy_pair()
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    policy = AdaptivePolicy(COSTS, k_max=2)
    config = DecodeConfig(k=2, max_new_tokens=8, policy=policy)
    spec = decode_prompts(target, [[1]] * 6, gens, config, ModelDrafter(draft), "lossless")
    plain = decode_prompts(target, [[1]] * 6, [torch.Generator().manual_seed(i) for i in range(6)],
                           DecodeConfig(max_new_tokens=8))
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids
        assert s.speculation["blocks_off"] == len(s.blocks) and set(s.speculation["k_per_block"]) == {0}
        assert s.stats()["verification"]["speculation"]["blocks_off"] == len(s.blocks)


def test_a_block_where_no_row_drafts_draws_from_each_rules_bonus_law():
    """A block where every row's k is 0 skips the draft call, the padding and the verification and
    draws each row's token from its own rule's bonus law with the block's one uniform: a lossless row
    gets plain sampling's tokens, a greedy row (bonus law: the argmax) plain greedy's, side by side in
    one decoder; each position is recorded as the bonus position it is, with the rule's law."""
    target, draft = toy_pair()
    policy = AdaptivePolicy(COSTS, k_max=2)  # from batch 4 on speculation cannot pay: nobody drafts
    dec = BatchDecoder(target, ModelDrafter(draft), "lossless", DecodeConfig(k=2, policy=policy))
    config = DecodeConfig(k=2, max_new_tokens=8, policy=policy)
    rows = {dec.add([1], torch.Generator().manual_seed(i), config, rule=rule): (rule, i)
            for i, rule in enumerate(["lossless", "greedy", "lossless", "greedy"])}
    done = {}
    while dec.active:
        done.update(dict(dec.step()))
    for row, (rule, seed) in rows.items():
        plain = decode_prompts(target, [[1]], [torch.Generator().manual_seed(seed)],
                               DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(
                                   temperature=0.0 if rule == "greedy" else 1.0)))[0]
        gen = done[row]
        assert gen.token_ids == plain.token_ids, rule
        assert all(b.proposed == 0 for b in gen.blocks) and gen.draft_calls == 0
        assert set(gen.steps["role"]) == {"bonus"}
        # the rule's law at each position: the target for lossless (TV 0), the argmax for greedy
        assert (max(gen.steps["tv"]) == 0.0) == (rule == "lossless")


def test_a_row_without_the_policy_keeps_its_k_beside_adaptive_rows():
    """In a decoder with a policy (the server's --k auto), a row added with its own k and no policy (a
    request that pins verification.k) drafts that k every block, even where the policy turns the
    adaptive rows' speculation off at the batch's size; its tokens are those of the row decoded alone
    with that k."""
    from verispec.decode import BatchDecoder, speculative_decode

    target, draft = toy_pair()
    policy = AdaptivePolicy(COSTS, k_max=2)  # from batch 4 on speculation cannot pay: adaptive rows off
    dec = BatchDecoder(target, ModelDrafter(draft), "lossless", DecodeConfig(k=2, policy=policy))
    pinned = dec.add([1], torch.Generator().manual_seed(50), DecodeConfig(k=2, max_new_tokens=10))
    # a row pinned wider than the costs were measured for (the server's max_k is above k="auto"'s)
    wide = dec.add([2], torch.Generator().manual_seed(51), DecodeConfig(k=5, max_new_tokens=10))
    adaptive = [dec.add([1], torch.Generator().manual_seed(i), DecodeConfig(k=2, max_new_tokens=10,
                                                                           policy=policy)) for i in range(4)]
    done = {}
    while dec.active:
        done.update(dict(dec.step()))
    alone = speculative_decode(target, ModelDrafter(draft), [1], "lossless",
                               DecodeConfig(k=2, max_new_tokens=10), torch.Generator().manual_seed(50))
    assert done[pinned].token_ids == alone.token_ids and done[pinned].blocks == alone.blocks
    wide_alone = speculative_decode(target, ModelDrafter(draft), [2], "lossless",
                                    DecodeConfig(k=5, max_new_tokens=10), torch.Generator().manual_seed(51))
    assert done[wide].token_ids == wide_alone.token_ids and done[wide].blocks[0].proposed == 5
    assert done[pinned].speculation is None and all(b.proposed > 0 for b in done[pinned].blocks[:-1])
    assert all(done[row].speculation["blocks_off"] > 0 for row in adaptive)
    with pytest.raises(ValueError, match="decoder's speculation policy"):
        dec.add([1], torch.Generator(), DecodeConfig(policy=AdaptivePolicy(COSTS, k_max=1)))


@pytest.mark.slow
def test_measured_costs_on_the_default_pair_drive_greedy_exactly():
    """Costs measured on this machine, whatever they are, change only how much is drafted: greedy
    speculative decoding still gives plain greedy decoding's tokens."""
    torch.set_num_threads(1)
    target = load_model("default")
    drafter = load_drafter("default-draft", target)
    prompt = target.encode("KING.\nWhat says the queen?\n")
    costs = measure_costs(target, drafter, prompt, k_max=3, batch_sizes=(1, 2), repeats=1)
    assert set(costs.summary()) == {"1", "2"} and len(costs.target[1]) == 4
    assert all(row == tuple(sorted(row)) for row in costs.target.values())
    greedy = SamplingConfig(temperature=0.0)
    config = DecodeConfig(k=3, max_new_tokens=24, sampling=greedy, policy=AdaptivePolicy(costs, 3))
    prompts = [prompt, target.encode("ROMEO.\nBut soft")]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    spec = decode_prompts(target, prompts, gens, config, drafter, "lossless")
    plain = decode_prompts(target, prompts, [None, None], DecodeConfig(max_new_tokens=24, sampling=greedy))
    assert [g.token_ids for g in spec] == [g.token_ids for g in plain]


@pytest.mark.slow
def test_generate_with_k_auto_reports_its_choices_and_keeps_greedy():
    import verispec

    auto = verispec.generate(["KING.\nWhat", "ROMEO.\nBut"], k="auto", max_new_tokens=16, temperature=0.0)
    plain = verispec.generate(["KING.\nWhat", "ROMEO.\nBut"], draft=None, max_new_tokens=16, temperature=0.0)
    for a, p in zip(auto, plain):
        assert a.token_ids == p.token_ids
        spec = a.stats["verification"]["speculation"]
        assert spec["policy"] == "adaptive" and set(spec["costs"]) == {"1", "2"}
        assert len(spec["k_per_block"]) == len(a.generation.blocks)
        assert all(0 <= k <= 8 for k in spec["k_per_block"])
    with pytest.raises(TypeError, match="or 'auto'"):
        verispec.generate("x", k="fast")


def test_a_new_row_starts_from_the_pooled_acceptance_of_earlier_rows():
    """`pool_tests`: a new row's prior is the earlier rows' counts scaled to weigh at most that many tests,
    so where they show speculation cannot pay it does not explore, and its own tests then take over. Off
    (0), every row starts from the uniform prior and explores."""
    dear = Costs(target={1: (1.0, 1.9, 2.2)}, draft={1: 0.2})  # only a high acceptance pays
    pooled = AdaptivePolicy(dear, k_max=2, explore=8, pool_tests=8)
    pool = RowAcceptance()
    for _ in range(10):  # earlier rows: 30 tests, 10 of them passed
        pool.update(proposed=2, accepted=1)
        pool.update(proposed=2, accepted=0)
    assert (pool.tests, pool.accepted) == (30, 10)
    row = pooled.new_row(pool)
    assert (row.prior_tests, row.prior_accepted) == (8, 3) and (row.tests, row.accepted) == (0, 0)
    assert row.evidence == (8, 3) and row.estimate == pytest.approx(4 / 10)
    assert pooled.choose_k(row.estimate, *row.evidence) == 0  # pooled evidence: paying is implausible
    fresh = RowAcceptance()
    assert pooled.choose_k(fresh.estimate, *fresh.evidence) == 2  # the same row without a prior explores
    assert AdaptivePolicy(dear, k_max=2, explore=8).new_row(pool) == RowAcceptance()  # pool_tests 0: off
    assert pooled.new_row(None) == RowAcceptance() and pooled.new_row(RowAcceptance()) == RowAcceptance()
    few = RowAcceptance(accepted=2, tests=3)  # fewer tests than pool_tests: taken whole
    assert (pooled.new_row(few).prior_tests, pooled.new_row(few).prior_accepted) == (3, 2)
    with pytest.raises(ValueError, match="pool_tests"):
        AdaptivePolicy(dear, k_max=2, pool_tests=-1)


def test_decoders_sharing_a_pool_start_later_rows_from_earlier_ones():
    """The server's engine passes one dict of pools to the decoders it creates one after another: a row
    added to a later decoder starts from the acceptance its predecessors saw with the same rule and
    settings; another rule starts fresh."""
    target, draft = toy_pair()
    policy = AdaptivePolicy(COSTS, k_max=2, by_batch=False, pool_tests=8)
    pools: dict = {}
    config = DecodeConfig(k=2, max_new_tokens=12, diagnostics=False, policy=policy)
    first = BatchDecoder(target, ModelDrafter(draft), "lossless", config, pools=pools)
    first.add([1], torch.Generator().manual_seed(0))
    while first.active:
        first.step()
    [(key, pool)] = pools.items()
    assert key[0] == "lossless" and pool.tests > 0
    second = BatchDecoder(target, ModelDrafter(draft), "lossless", config, pools=pools)
    row = second.add([1], torch.Generator().manual_seed(1))
    other = second.add([1], torch.Generator().manual_seed(2), rule="lenience:l=0.5")
    seen = second._rows[row].acceptance
    assert seen.prior_tests == min(8, pool.tests) and seen.tests == 0
    assert second._rows[other].acceptance.prior_tests == 0


def test_the_other_work_per_position_counts_against_drafting():
    """`Costs.position` (o): a block of k drafts does 2k + 1 positions of other work, plain decoding one,
    so a large o moves the choice to plain decoding where the passes alone would draft."""
    with_o = Costs(target=COSTS.target, draft=COSTS.draft, position={1: 0.2, 4: 0.0})
    assert row_seconds_per_token(with_o, 0.5, 1) == pytest.approx((0.1 + 1.2 + 3 * 0.2) / 1.5)
    assert row_seconds_per_token(with_o, 0.5, 0) == pytest.approx(1.2)
    assert AdaptivePolicy(COSTS, k_max=2).choose_k(0.5) == 1
    assert AdaptivePolicy(with_o, k_max=2).choose_k(0.5) == 0  # 1.267 s a token drafting, 1.2 plain
    assert AdaptivePolicy(with_o, k_max=2).choose_k(0.95) == 2
    assert with_o.summary()["1"]["o"] == pytest.approx(0.2) and COSTS.summary()["1"]["o"] == 0.0
    # a batch of two at size-1 costs: (2 draft steps + 3-token pass + o (5 + 5)) for 2 E(0.9, 2) tokens
    policy = AdaptivePolicy(with_o, k_max=2, by_batch=True)
    block = 2 * 0.1 + 1.4 + 0.2 * 10
    assert policy.pays([0.9, 0.9], [2, 2]) == (2 * expected_tokens(0.9, 2) / block > 2 / (1.0 + 2 * 0.2))
    for bad in ({1: -0.1}, {1: float("nan")}, {2: 0.1}):
        with pytest.raises(ValueError, match="per-position"):
            Costs(target=COSTS.target, draft=COSTS.draft, position=bad)


def test_position_costs_are_measured_on_real_blocks():
    """`decode.position_costs` on the toy pair: each measured batch size gets a finite o >= 0 and the pass
    costs are kept as they were."""
    target, draft = toy_pair()
    costs = measure_costs(target, ModelDrafter(draft), [1], 2, (1, 2))
    measured = position_costs(costs, target, ModelDrafter(draft), [1], blocks=2)
    assert measured.target == costs.target and measured.draft == costs.draft
    assert set(measured.position) == {1, 2} and all(0 <= o < 1 for o in measured.position.values())
    with pytest.raises(ValueError, match="k must be"):
        position_costs(costs, target, ModelDrafter(draft), [1], k=3)


def test_a_margin_keeps_plain_decoding_where_drafting_barely_pays():
    """`margin`: drafting must beat plain decoding by that fraction on the model's numbers, per row and for
    the batch; where it does by more, the choice is the margin-free one."""
    # at a = 0.5, k = 1 costs 0.867 s a token against plain's 1.0: a 15% gain
    assert AdaptivePolicy(COSTS, k_max=2, margin=0.1).choose_k(0.5) == 1
    assert AdaptivePolicy(COSTS, k_max=2, margin=0.2).choose_k(0.5) == 0
    assert AdaptivePolicy(COSTS, k_max=2, margin=0.2).choose_k(0.95) == 2
    free, hedged = AdaptivePolicy(COSTS, k_max=2), AdaptivePolicy(COSTS, k_max=2, margin=0.2)
    assert hedged.break_even > free.break_even
    # batch 2 at size-1 costs: 2 E(0.6, 1) = 3.2 tokens per 1.3 s (2.46 a second) against plain's 2 a second
    assert free.pays([0.6, 0.6], [1, 1]) and hedged.pays([0.6, 0.6], [1, 1])  # 2.46 > 1.2 x 2
    assert not AdaptivePolicy(COSTS, k_max=2, margin=0.25).pays([0.6, 0.6], [1, 1])  # 2.46 < 1.25 x 2
    with pytest.raises(ValueError, match="margin"):
        AdaptivePolicy(COSTS, k_max=2, margin=-0.1)
