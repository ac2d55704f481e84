import math

import torch

from fusedrl.rollout_fusion.remaining import remaining_lengths


def test_with_no_request_finished_every_request_runs_to_its_budget():
    assert remaining_lengths([[(5, 20), (5, 12)], [(3, 9)]], []) == [[15, 7], [6]]


def test_requests_cut_at_their_budget_are_no_evidence_of_stopping():
    # three finished at their budget of 10 (censored): nothing ever stopped, so the unfinished one runs to its own, 20
    assert remaining_lengths([[(5, 20)]], [(10, True)] * 3) == [[15]]


def test_a_hand_computed_estimate():
    # Stops at lengths 2 and 4; two requests still running at 4 (budget 30), one on each instance.
    # At risk: length 1: 4, length 2: 4 (1 stops), 3: 3, 4: 3 (1 stops): past 4 the hazard is the mean over 1..4,
    # 2 stops / 14 tokens at risk = 1/7, so P(stopped within k more tokens) = 1 - (6/7)^k. The two requests take the
    # quantiles 0.25 and 0.75: k = 2 (1 - (6/7)^2 = 0.265) and k = 9 (1 - (6/7)^9 = 0.750 > 0.75 at k = 9, 0.708 at 8).
    assert remaining_lengths([[(4, 30)], [(4, 30)]], [(2, False), (4, False)]) == [[2], [9]]
    # with a budget of 10 the long one is cut at the 6 tokens it has left
    assert remaining_lengths([[(4, 10)], [(4, 10)]], [(2, False), (4, False)]) == [[2], [6]]


def test_the_estimate_follows_the_true_length_distribution():
    # 40000 requests of geometric lengths (stop probability 1% a token) cut at 400, seen when 100 tokens in
    uniform = torch.rand(40000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lengths = (torch.log(uniform) / math.log(0.99)).ceil().clamp(1, 400).long().tolist()
    now = 100
    finished = [(n, n >= 400) for n in lengths if n <= now]
    running = [n for n in lengths if n > now]
    estimate = remaining_lengths([[(now, 400)] * len(running)], finished)[0]
    true_left = sum(n - now for n in running)  # ~14700 requests: its sampling error is ~0.7%
    assert abs(sum(estimate) - true_left) < 0.03 * true_left
    at_budget = sum(n == 400 for n in running) / len(running)
    assert abs(sum(k == 300 for k in estimate) / len(estimate) - at_budget) < 0.02


def test_long_and_short_estimates_are_dealt_evenly_to_the_instances():
    # 8 requests at the same length on 2 instances: the quantiles go 0, 1 | 1, 0 | 0, 1 | 1, 0 (a snake)
    finished = [(n, False) for n in range(2, 40, 3)]
    estimate = remaining_lengths([[(40, 400)] * 4, [(40, 400)] * 4], finished)
    ranked = sorted(estimate[0] + estimate[1])
    assert sorted(estimate[0]) == [ranked[0], ranked[3], ranked[4], ranked[7]]
    assert sorted(estimate[1]) == [ranked[1], ranked[2], ranked[5], ranked[6]]
    assert len(set(ranked)) > 4  # the quantiles differ: not one figure for all
