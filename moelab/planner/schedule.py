"""What torch.distributed.pipelining's schedules do with FSDP2 on one pipeline rank, as the planner counts it
(torch-free; tests/planner/test_schedule.py checks it against torch's own schedule code):

    interleaved_order(pp=4, vp=2, m=8, rank=0)      # [(stage, "F" | "B"), ...] this rank's compute order
    interleaved_gathers(pp=4, vp=8, m=8, rank=0)    # {stage: all-gathers per step}

- 1F1B and GPipe (one stage per rank, Schedule1F1B / ScheduleGPipe): each backward but the last runs with
  FSDP2's gradient sync off and its blocks kept gathered (PipelineStage.backward_maybe_with_nosync); after the
  last, perform_reduce_grad reduce-scatters every gradient once and makes the compute stream wait for it.
- Interleaved 1F1B (ScheduleInterleaved1F1B, a _PipelineScheduleRuntime): the compute order of
  _get_1f1b_rank_ops, and FSDP2 actions added by _add_unshard_reshard: before each compute action the next
  three distinct stages this rank computes are kept gathered (UNSHARD, asynchronous, so a prefetch) and the
  others resharded, so a rank with more than three stages gathers a stage again each time it comes back; a
  stage's REDUCE_GRAD follows its last backward.
"""
from __future__ import annotations

MAX_ACTIVE_STAGES = 3  # torch.distributed.pipelining.schedules._add_unshard_reshard's default


def interleaved_order(pp: int, vp: int, m: int, rank: int) -> list[tuple[int, str]]:
    """This rank's compute actions under ScheduleInterleaved1F1B, in order: (stage index, "F" or "B")."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((vp - 1) * per_round + 2 * (pp - 1 - rank), m * vp)
    ops = vp * m

    def forward(step: int) -> int:
        return (step // per_round) % vp * pp + rank

    def backward(step: int) -> int:
        return (vp - 1 - ((step - warmup) // per_round) % vp) * pp + rank

    out = []
    for step in range(ops + warmup):  # warm-up forwards, one forward + one backward, cool-down backwards
        if step < warmup:
            out.append((forward(step), "F"))
        elif step < ops:
            out += [(forward(step), "F"), (backward(step), "B")]
        else:
            out.append((backward(step), "B"))
    return out


def interleaved_gathers(pp: int, vp: int, m: int, rank: int) -> dict[int, int]:
    """All-gathers per step of each of this rank's stages (UNSHARD actions of _add_unshard_reshard)."""
    order = [stage for stage, _ in interleaved_order(pp, vp, m, rank)]
    active: set[int] = set()
    gathers: dict[int, int] = {}
    for i in range(len(order)):
        upcoming: list[int] = []
        for stage in order[i:]:
            if stage not in upcoming:
                upcoming.append(stage)
                if len(upcoming) == MAX_ACTIVE_STAGES:
                    break
        active -= {s for s in active if s not in upcoming}
        for stage in upcoming:
            if stage not in active:
                active.add(stage)
                gathers[stage] = gathers.get(stage, 0) + 1
    return gathers
