import pytest

from fusedrl.pipelining import ProgramError, lower, verify_program
from fusedrl.pipelining.cost import CostModel
from fusedrl.pipelining.ir import ACTOR, CRITIC, Action, Placement
from fusedrl.pipelining.lowering import COMM_KINDS, message_of, peer_of
from fusedrl.pipelining.search import fused_schedule, sequential_1f1b

CONFIGS = [  # pp, critic stages, actor micro-batches, critic micro-batches (per replica)
    (2, None, 4, 4),
    (2, None, 3, 5),
    (3, None, 4, 2),
    (4, None, 4, 4),
    (4, 2, 4, 3),
    (8, None, 8, 6),
    (2, None, 4, 0),  # critic-free: the Actor alone
    (4, 2, 4, 0),
]


def _pair_messages(program, placement, rank, peer):
    return [message_of(a) for a in program.programs[rank] if a.kind in COMM_KINDS and peer_of(a, placement) == peer]


@pytest.mark.parametrize("pp,critic_stages,ma,mc", CONFIGS)
def test_planner_programs_pass_the_verifier(pp, critic_stages, ma, mc):
    placement = Placement(pp, critic_stages)
    costs = CostModel.uniform(placement, 1.0, 0.6)
    counts = {ACTOR: ma, CRITIC: mc}
    schedules = [sequential_1f1b(placement, ma, mc), fused_schedule(placement, costs, ma, mc, budget_s=0.2).schedule]
    schedules.append(fused_schedule(placement, costs, ma, mc, budget_s=0.2, split_backward=True).schedule)
    assert {a.kind for acts in schedules[-1].values() for a in acts} == {"F", "I", "W"}
    for schedule in schedules:
        program = lower(schedule, placement, counts)
        verify_program(program.programs, placement, counts)
        # compute order per rank is the schedule's; every message is posted in one order at both ends
        for r, acts in schedule.items():
            assert [a for a in program.programs[r] if a.kind not in COMM_KINDS] == acts
        for r in range(pp):
            for peer in range(pp):
                if r != peer:
                    assert _pair_messages(program, placement, r, peer) == _pair_messages(program, placement, peer, r)
        sends = sum(a.kind.startswith("SEND") for p in program.programs.values() for a in p)
        replicas = placement.critic_replicas
        assert sends == 2 * ((pp - 1) * ma + replicas * (placement.num_stages(CRITIC) - 1) * mc)


def _program(pp=2, m=2):
    placement = Placement(pp)
    counts = {ACTOR: m, CRITIC: m}
    costs = CostModel.uniform(placement, 1.0, 1.0)
    return lower(fused_schedule(placement, costs, m, m, budget_s=0.2).schedule, placement, counts), placement, counts


def test_swapped_messages_on_one_end_are_rejected():
    placement, counts = Placement(2), {ACTOR: 2, CRITIC: 2}
    program = lower(sequential_1f1b(placement, 2, 2), placement, counts)
    progs = {r: list(p) for r, p in program.programs.items()}
    # two same-shaped activations posted back to back: swapping them keeps rank 1's own order valid
    i = next(i for i, (a, b) in enumerate(zip(progs[1], progs[1][1:])) if a.kind == b.kind == "RECV_F")
    progs[1][i], progs[1][i + 1] = progs[1][i + 1], progs[1][i]
    with pytest.raises(ProgramError, match=r"message #\d+ between ranks 0 and 1 differs: rank 0 posts actor:SEND_F0"):
        verify_program(progs, placement, counts)


def test_compute_before_its_receive_is_rejected():
    program, placement, counts = _program()
    progs = {r: list(p) for r, p in program.programs.items()}
    f = Action(ACTOR, 1, 0, "F")
    progs[1].remove(f)
    progs[1].insert(0, f)
    with pytest.raises(ProgramError, match=r"rank 1 action #0 actor:F1.mb0: runs before receiving actor:F0->1.mb0"):
        verify_program(progs, placement, counts)


def test_missing_message_and_missing_backward_are_rejected():
    program, placement, counts = _program()
    progs = {r: list(p) for r, p in program.programs.items()}
    progs[0] = [a for a in progs[0] if a != Action(ACTOR, 0, 1, "SEND_F")]
    with pytest.raises(ProgramError, match="never posts its match|differs"):
        verify_program(progs, placement, counts)
    progs = {r: [a for a in p if a != Action(CRITIC, 0, 0, "B")] for r, p in program.programs.items()}
    with pytest.raises(ProgramError, match=r"never runs the backward of critic:F0.mb0"):
        verify_program(progs, placement, counts)


def test_cyclic_schedule_cannot_be_lowered():
    placement = Placement(2)
    # each rank first waits for the other model's activation, which the other rank only sends afterwards
    schedule = {
        0: [Action(CRITIC, 1, 0, "F"), Action(ACTOR, 0, 0, "F"), Action(CRITIC, 1, 0, "B"), Action(ACTOR, 0, 0, "B")],
        1: [Action(ACTOR, 1, 0, "F"), Action(CRITIC, 0, 0, "F"), Action(ACTOR, 1, 0, "B"), Action(CRITIC, 0, 0, "B")],
    }
    with pytest.raises(ProgramError, match=r"rank 0 waits at critic:F1.mb0; rank 1 waits at actor:F1.mb0"):
        lower(schedule, placement, {ACTOR: 1, CRITIC: 1})


def test_action_on_the_wrong_rank_is_rejected():
    program, placement, counts = _program()
    progs = {r: list(p) for r, p in program.programs.items()}
    progs[0].append(Action(ACTOR, 1, 0, "W"))
    with pytest.raises(ProgramError, match="stage lives on rank 1"):
        verify_program(progs, placement, counts)


def test_the_nccl_model_rejects_a_wait_cycle_across_three_ranks():
    """Posted without blocking, per pair in order, these messages all match; on NCCL each rank runs its P2P
    operations on one stream in posting order, and every rank waits behind a receive whose sender waits too.
    (Rank 2's two messages are kept in separate batches by a compute action between them: posted as one batch,
    as consecutive messages with one peer are, they would progress together and break the cycle.)"""
    from fusedrl.pipelining.lowering import RECV_B, RECV_F, SEND_B, SEND_F, _simulate_streams

    placement = Placement(3)
    programs = {
        0: [Action(ACTOR, 0, 0, RECV_B)],  # x from rank 1
        1: [Action(ACTOR, 1, 0, RECV_B), Action(ACTOR, 1, 0, SEND_B), Action(ACTOR, 1, 0, SEND_F)],  # y, then x, z
        2: [Action(ACTOR, 2, 0, RECV_F), Action(CRITIC, 0, 0, "F"), Action(ACTOR, 2, 0, SEND_B)],  # z, then y
    }
    with pytest.raises(ProgramError, match="deadlocks"):
        _simulate_streams(programs, placement)
    programs[1] = [programs[1][2], programs[1][0], programs[1][1]]  # rank 1 sends z first: every batch completes
    _simulate_streams(programs, placement)
    programs[1] = [programs[1][1], programs[1][2], programs[1][0]]  # the cycle again ...
    programs[2] = [programs[2][0], programs[2][2], programs[2][1]]  # ... broken by one batch [recv z, send y]
    _simulate_streams(programs, placement)


def test_consecutive_messages_with_one_peer_form_one_batch():
    from fusedrl.pipelining.lowering import comm_batches

    placement, counts = Placement(2), {ACTOR: 4, CRITIC: 4}
    program = lower(
        fused_schedule(placement, CostModel.uniform(placement, 1.0, 0.7), 4, 4, budget_s=0.2).schedule, placement, counts
    )
    for prog in program.programs.values():
        batches = comm_batches(prog, placement)
        assert sorted(i for b in batches for i in b) == [i for i, a in enumerate(prog) if a.kind in COMM_KINDS]
        for batch in batches:
            assert batch == list(range(batch[0], batch[-1] + 1))  # consecutive positions, one peer
            assert len({peer_of(prog[i], placement) for i in batch}) == 1
    assert any(len(b) > 1 for r, prog in program.programs.items() for b in comm_batches(prog, placement))


def test_a_critic_free_program_holds_no_critic_action():
    placement = Placement(2)
    counts = {ACTOR: 2, CRITIC: 0}
    program = lower(sequential_1f1b(placement, 2, 0), placement, counts)
    assert {a.model for p in program.programs.values() for a in p} == {ACTOR}
    progs = {r: list(p) for r, p in program.programs.items()}
    progs[1].append(Action(CRITIC, 0, 0, "F"))
    with pytest.raises(ProgramError, match=r"rank 1 action #\d+ critic:F0\.mb0: micro-batch out of range \[0, 0\)"):
        verify_program(progs, placement, counts)
    with pytest.raises(ProgramError, match=r"microbatches has no entry for 'critic' \(0 for a Critic that does not train\)"):
        lower(sequential_1f1b(placement, 2, 0), placement, {ACTOR: 2})
