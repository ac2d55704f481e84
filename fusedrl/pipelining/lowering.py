"""Lowering of a compute schedule into per-rank programs with explicit SEND/RECV, and its verifier.

Two pipelines cross on the same ranks (Actor activations flow up the ranks, Critic activations flow
down), so every pair of ranks carries messages of both models in both directions. NCCL ignores P2P
tags and matches messages first-in-first-out per rank pair, and its P2P operations between two ranks
share one stream per side; gloo matches by (peer, tag) in posting order, so two same-shaped messages
posted in different orders are silently swapped. The lowering therefore gives every rank pair one
global message order, posted identically at both ends, and :func:`verify_program` proves it for
every program before it runs:

1. each compute action runs exactly once, on the rank that holds its stage, after its inputs;
2. the two ends of every rank pair post the same messages in the same order (both directions
   interleaved);
3. a simulation of NCCL's behaviour runs every program to the end: no deadlock. The executor posts each
   maximal run of consecutive communication actions towards one peer as one batch
   (:func:`comm_batches`: a pair's opposite-direction messages in one NCCL group, progressing together).
   In the simulation each rank has one stream for all its P2P batches, run in posting order (a batch
   starts when the previous one has completed and every compute action posted before it has run);
   an operation matches its peer's only while both batches run, in the pair's first-in-first-out
   order; a batch completes when all its operations matched; a compute action waits for the batch
   that receives its input.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, replace

from fusedrl.pipelining.ir import COMPUTE_KINDS, CRITIC, MODELS, Action, Placement, Schedule

SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMM_KINDS: tuple[str, ...] = (SEND_F, RECV_F, SEND_B, RECV_B)

Program = dict[int, list[Action]]
"""Per-rank ordered compute and communication actions."""


class ProgramError(ValueError):
    """A lowered program is malformed, mis-ordered or would deadlock."""


@dataclass(frozen=True)
class Message:
    """One activation (``F``) or gradient (``B``) tensor set sent between two adjacent stages."""

    model: str
    replica: int
    microbatch: int
    direction: str  # "F": stage -> stage+1; "B": stage -> stage-1
    src_stage: int

    @property
    def dst_stage(self) -> int:
        return self.src_stage + 1 if self.direction == "F" else self.src_stage - 1

    def __str__(self) -> str:
        rep = f"r{self.replica}" if self.replica else ""
        return f"{self.model}{rep}:{self.direction}{self.src_stage}->{self.dst_stage}.mb{self.microbatch}"


@dataclass(frozen=True)
class LoweredProgram:
    """Per-rank programs of one minibatch plus what is needed to check and run them."""

    placement: Placement
    microbatches: dict[str, int]  # model -> number of micro-batches
    programs: Program

    def verify(self) -> None:
        verify_program(self.programs, self.placement, self.microbatches)


def message_of(action: Action) -> Message:
    """The message a communication action sends or receives."""
    k, s = action.kind, action.stage
    if k == SEND_F:
        return Message(action.model, action.replica, action.microbatch, "F", s)
    if k == RECV_F:
        return Message(action.model, action.replica, action.microbatch, "F", s - 1)
    if k == SEND_B:
        return Message(action.model, action.replica, action.microbatch, "B", s)
    if k == RECV_B:
        return Message(action.model, action.replica, action.microbatch, "B", s + 1)
    raise ValueError(f"{action} is not a communication action")


def peer_of(action: Action, placement: Placement) -> int:
    """The rank at the other end of a communication action."""
    m = message_of(action)
    other = m.dst_stage if action.kind in (SEND_F, SEND_B) else m.src_stage
    return placement.rank_of(action.model, other, action.replica)


def _produces(action: Action, placement: Placement) -> Message | None:
    """The message a compute action must send once it has run (None if the consumer is on this rank)."""
    n = placement.num_stages(action.model)
    if action.kind == "F" and action.stage < n - 1:
        msg = Message(action.model, action.replica, action.microbatch, "F", action.stage)
    elif action.kind in ("B", "I") and action.stage > 0:
        msg = Message(action.model, action.replica, action.microbatch, "B", action.stage)
    else:
        return None
    src = placement.rank_of(msg.model, msg.src_stage, msg.replica)
    dst = placement.rank_of(msg.model, msg.dst_stage, msg.replica)
    if src == dst:
        raise ProgramError(
            f"{action}: stages {msg.src_stage} and {msg.dst_stage} share rank {src}; "
            "the lowering needs adjacent stages on different ranks"
        )
    return msg


def needed_message(action: Action, placement: Placement) -> Message | None:
    """The message a compute action must have received before it runs."""
    n = placement.num_stages(action.model)
    if action.kind == "F" and action.stage > 0:
        return Message(action.model, action.replica, action.microbatch, "F", action.stage - 1)
    if action.kind in ("B", "I") and action.stage < n - 1:
        return Message(action.model, action.replica, action.microbatch, "B", action.stage + 1)
    return None


def _local_deps(action: Action) -> list[Action]:
    """Compute actions of the same stage and micro-batch that must run first on this rank."""
    if action.kind in ("B", "I"):
        return [replace(action, kind="F")]
    if action.kind == "W":
        return [replace(action, kind="I")]
    return []


def _comm(kind: str, msg: Message) -> Action:
    stage = msg.src_stage if kind in (SEND_F, SEND_B) else msg.dst_stage
    return Action(msg.model, stage, msg.microbatch, kind, msg.replica)


def lower(schedule: Schedule, placement: Placement, microbatches: dict[str, int]) -> LoweredProgram:
    """Insert SEND/RECV actions into a compute schedule and verify the result.

    Compute actions keep their per-rank order. The pass walks the ranks round-robin and emits a
    rank's next compute action once its input message has been received; a produced message is
    appended as SEND on the sender and RECV on the receiver in the same step, so every rank pair sees
    all its messages in one global order at both ends.
    """
    todo = {r: deque(acts) for r, acts in schedule.items()}
    programs: Program = {r: [] for r in range(placement.pp)}
    for r in todo:
        if r not in programs:
            raise ProgramError(f"schedule has rank {r} but placement has pp={placement.pp}")
    received: dict[int, set[Message]] = defaultdict(set)
    while any(todo.values()):
        progress = False
        for r in sorted(todo):
            while todo[r]:
                act = todo[r][0]
                if act.kind not in COMPUTE_KINDS:
                    raise ProgramError(f"rank {r}: {act} has kind {act.kind!r}; a schedule holds only {COMPUTE_KINDS}")
                need = needed_message(act, placement)
                if need is not None and need not in received[r]:
                    break
                todo[r].popleft()
                programs[r].append(act)
                progress = True
                msg = _produces(act, placement)
                if msg is not None:
                    dst = placement.rank_of(msg.model, msg.dst_stage, msg.replica)
                    programs[r].append(_comm(SEND_F if msg.direction == "F" else SEND_B, msg))
                    programs[dst].append(_comm(RECV_F if msg.direction == "F" else RECV_B, msg))
                    received[dst].add(msg)
        if not progress:
            stuck = "; ".join(f"rank {r} waits at {todo[r][0]}" for r in sorted(todo) if todo[r])
            raise ProgramError(f"schedule cannot be lowered, every rank waits for a message never sent: {stuck}")
    lowered = LoweredProgram(placement, dict(microbatches), programs)
    lowered.verify()
    return lowered


def verify_program(programs: Program, placement: Placement, microbatches: dict[str, int]) -> None:
    """Raise :class:`ProgramError` naming the first offending action unless the program is safe to run."""
    _check_actions(programs, placement, microbatches)
    _check_pair_order(programs, placement)
    _simulate_streams(programs, placement)


def comm_batches(program: list[Action], placement: Placement) -> list[list[int]]:
    """Positions of one rank's communication actions grouped as the executor posts them: each maximal run of
    consecutive communication actions with the same peer is one P2P batch."""
    batches: list[list[int]] = []
    for i, act in enumerate(program):
        if act.kind not in COMM_KINDS:
            continue
        prev = batches[-1][-1] if batches else None
        if prev == i - 1 and peer_of(program[prev], placement) == peer_of(act, placement):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _check_actions(programs: Program, placement: Placement, microbatches: dict[str, int]) -> None:
    expected: set[Action] = set()
    for model in MODELS:
        if model not in microbatches:
            raise ProgramError(f"microbatches has no entry for {model!r} (0 for a Critic that does not train)")
        replicas = placement.critic_replicas if model == CRITIC else 1
        for rep in range(replicas):
            for s in range(placement.num_stages(model)):
                for mb in range(microbatches[model]):
                    expected.add(Action(model, s, mb, "F", rep))
    seen: set[Action] = set()
    for r, prog in sorted(programs.items()):
        done: set[Action] = set()
        got: set[Message] = set()
        computed: set[Message] = set()
        for i, act in enumerate(prog):
            where = f"rank {r} action #{i} {act}"
            if act.model not in MODELS:
                raise ProgramError(f"{where}: unknown model {act.model!r}")
            if act.kind not in COMM_KINDS and act.kind not in COMPUTE_KINDS:
                raise ProgramError(f"{where}: unknown kind {act.kind!r}")
            try:
                owner = placement.rank_of(act.model, act.stage, act.replica)
                if act.kind in COMM_KINDS and peer_of(act, placement) == r:
                    raise ProgramError(f"{where}: sends to its own rank")
            except ValueError as e:
                raise ProgramError(f"{where}: {e}") from None
            if owner != r:
                raise ProgramError(f"{where}: stage lives on rank {owner}")
            if not 0 <= act.microbatch < microbatches[act.model]:
                raise ProgramError(f"{where}: micro-batch out of range [0, {microbatches[act.model]})")
            if act in done:
                raise ProgramError(f"{where}: appears twice")
            if act.kind in (RECV_F, RECV_B):
                got.add(message_of(act))
            elif act.kind in (SEND_F, SEND_B):
                if message_of(act) not in computed:
                    raise ProgramError(f"{where}: sends {message_of(act)} before computing it")
            else:
                need = needed_message(act, placement)
                if need is not None and need not in got:
                    raise ProgramError(f"{where}: runs before receiving {need}")
                for dep in _local_deps(act):
                    if dep not in done:
                        raise ProgramError(f"{where}: runs before {dep}")
                other = {"B": "I", "I": "B"}.get(act.kind)
                if other and Action(act.model, act.stage, act.microbatch, other, act.replica) in done:
                    raise ProgramError(f"{where}: micro-batch already has a backward")
                msg = _produces(act, placement)
                if msg is not None:
                    computed.add(msg)
            done.add(act)
        seen |= done
    for act in sorted(expected):
        if act not in seen:
            raise ProgramError(f"program never runs {act}")
        if replace(act, kind="B") not in seen and replace(act, kind="W") not in seen:
            raise ProgramError(f"program never runs the backward of {act}")
    for act in seen:
        if act.kind in COMPUTE_KINDS and Action(act.model, act.stage, act.microbatch, "F", act.replica) not in expected:
            raise ProgramError(f"program runs {act}, which is outside the placement or micro-batch counts")


def _pair_sequences(programs: Program, placement: Placement) -> dict[tuple[int, int], list[tuple[Action, Message]]]:
    """For each (rank, peer): the communication actions rank posts towards peer, in order."""
    seqs: dict[tuple[int, int], list[tuple[Action, Message]]] = defaultdict(list)
    for r, prog in programs.items():
        for act in prog:
            if act.kind in COMM_KINDS:
                seqs[(r, peer_of(act, placement))].append((act, message_of(act)))
    return seqs


def _check_pair_order(programs: Program, placement: Placement) -> None:
    seqs = _pair_sequences(programs, placement)
    for a, b in sorted({tuple(sorted(k)) for k in seqs}):
        sa, sb = seqs.get((a, b), []), seqs.get((b, a), [])
        for i in range(max(len(sa), len(sb))):
            if i >= len(sa) or i >= len(sb):
                extra_rank, (act, msg) = (a, sa[i]) if i < len(sa) else (b, sb[i])
                raise ProgramError(
                    f"rank {extra_rank} posts {act} ({msg}) as message #{i} of pair ({a},{b}) but the peer never posts its match"
                )
            (act_a, ma), (act_b, mb) = sa[i], sb[i]
            mirrored = ma == mb and ({act_a.kind, act_b.kind} in ({SEND_F, RECV_F}, {SEND_B, RECV_B}))
            if not mirrored:
                raise ProgramError(
                    f"message #{i} between ranks {a} and {b} differs: rank {a} posts {act_a} ({ma}), "
                    f"rank {b} posts {act_b} ({mb}); both ends must post one message order"
                )


def _simulate_streams(programs: Program, placement: Placement) -> None:
    """Run the programs under the NCCL model of the module doc (one P2P stream per rank, batches as posted)."""
    batches = {r: comm_batches(prog, placement) for r, prog in programs.items()}
    computes = {r: [i for i, a in enumerate(prog) if a.kind not in COMM_KINDS] for r, prog in programs.items()}
    cpos = {r: 0 for r in programs}  # next compute action (index into computes[r])
    bpos = {r: 0 for r in programs}  # next (or running) batch
    running: dict[int, int] = {}  # rank -> batch index
    matched: set[tuple[int, int]] = set()  # (rank, action position)
    received: dict[int, set[Message]] = defaultdict(set)
    while True:
        progress = False
        for r, prog in programs.items():
            while cpos[r] < len(computes[r]):
                need = needed_message(prog[computes[r][cpos[r]]], placement)
                if need is not None and need not in received[r]:
                    break
                cpos[r] += 1
                progress = True
            done_up_to = computes[r][cpos[r]] if cpos[r] < len(computes[r]) else len(prog)
            if r not in running and bpos[r] < len(batches[r]) and batches[r][bpos[r]][0] < done_up_to:
                running[r] = bpos[r]  # every compute action posted before the batch has run
                progress = True
        for r, b in list(running.items()):
            for i in batches[r][b]:
                act = programs[r][i]
                peer = peer_of(act, placement)
                if (r, i) in matched or peer not in running:
                    continue
                for j in batches[peer][running[peer]]:
                    if (peer, j) not in matched and message_of(programs[peer][j]) == message_of(act):
                        matched.update({(r, i), (peer, j)})
                        progress = True
        for r, b in list(running.items()):
            if all((r, i) in matched for i in batches[r][b]):
                for i in batches[r][b]:
                    if programs[r][i].kind in (RECV_F, RECV_B):
                        received[r].add(message_of(programs[r][i]))
                del running[r]
                bpos[r] += 1
                progress = True
        if all(cpos[r] == len(computes[r]) and bpos[r] == len(batches[r]) for r in programs):
            return
        if not progress:
            blocked = [f"rank {r} at {programs[r][computes[r][cpos[r]]]}" for r in sorted(programs) if cpos[r] < len(computes[r])]
            waiting = [f"rank {r} batch {[str(programs[r][i]) for i in batches[r][b]]}" for r, b in sorted(running.items())]
            raise ProgramError("program deadlocks: " + "; ".join(blocked + waiting))
