"""Pipeline schedules: the order in which each stage runs its microbatches' forwards and backwards.

A schedule is, per stage, a list of actions ("F", i) (forward of microbatch i) and
("B", i) (its backward). Both schedules give the same gradients; they differ in how many
microbatches' activations a stage holds at once and in nothing else:

  gpipe  every forward, then every backward (GPipe, Huang et al. 2019): a stage holds
         the activations of all M microbatches until its backwards start.
  1f1b   stage s runs p - s - 1 forwards to fill the pipeline, then alternates one
         forward and one backward, then drains (PipeDream-Flush, Megatron-LM's
         default): stage s holds at most p - s microbatches' activations.

With p stages, M microbatches and every action taking one slot, both take 2(M + p - 1)
slots of which each stage is busy 2M: the bubble is (p - 1) / (M + p - 1) of a step.
"""

from __future__ import annotations

from typing import Sequence

Action = tuple  # ("F" | "B", microbatch)

SCHEDULES = ("gpipe", "1f1b")


def gpipe(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """All forwards, then all backwards."""
    del stage, num_stages
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[Action]:
    """Fill with p - s - 1 forwards, alternate one forward and one backward, drain the backwards."""
    warmup = min(num_stages - stage - 1, microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return actions


def schedule(name: str, num_stages: int, microbatches: int) -> list[list[Action]]:
    """Every stage's actions under schedule `name` ("gpipe" or "1f1b")."""
    make = {"gpipe": gpipe, "1f1b": one_f_one_b}[name]
    return [make(s, num_stages, microbatches) for s in range(num_stages)]


def timeline(stages: Sequence[Sequence[Action]]) -> list[tuple[int, int, Action]]:
    """When each action runs if every action takes one slot and a stage runs its actions in
    order, each as soon as its inputs exist: [(slot, stage, action)], by slot.

    F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i).

    Raises:
      ValueError: the actions deadlock (a stage waits on something never run).
    """
    p = len(stages)
    done: dict[tuple, int] = {}  # (kind, stage, microbatch) -> slot it ran in
    position = [0] * p
    out = []
    slot = 0
    while any(position[s] < len(stages[s]) for s in range(p)):
        ran = []
        for s in range(p):
            if position[s] == len(stages[s]):
                continue
            kind, i = stages[s][position[s]]
            needs = [("F", s - 1, i)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs = [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else [])
            if all(done.get(n, slot) < slot for n in needs):
                ran.append((s, (kind, i)))
        if not ran:
            raise ValueError(f"pipeline schedule deadlocks at slot {slot}")
        for s, action in ran:
            done[(action[0], s, action[1])] = slot
            position[s] += 1
            out.append((slot, s, action))
        slot += 1
    return out


def in_flight(actions: Sequence[Action]) -> int:
    """The most microbatches whose forward has run and backward not yet, along one stage's actions."""
    alive = peak = 0
    for kind, _ in actions:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def bubble_fraction(num_stages: int, microbatches: int) -> float:
    """The theoretical idle share of a step, (p - 1) / (M + p - 1)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)


def measured_bubble(stages: Sequence[Sequence[Action]]) -> float:
    """Idle share of the slots of `timeline` (every action one slot), averaged over the stages."""
    events = timeline(stages)
    span = max(slot for slot, _, _ in events) + 1
    busy = sum(len(a) for a in stages)
    return 1.0 - busy / (span * len(stages))
