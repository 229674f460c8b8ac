"""StepSession (marble_trl.trainer.session): one optimizer step's micro-batches and the balancer's transaction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marble_trl.balance import MarbleBalancer
from marble_trl.trainer.session import StepSession
from marble_trl.trainer.step import MicroBatch, StepPlan


def _batches(n: int) -> list[MicroBatch]:
    plan = StepPlan("solve_first", torch.zeros(2), torch.tensor([True, True]))
    return [  # tensors of several elements, as in a run (their == is elementwise)
        MicroBatch(torch.zeros(2, 1, 2, 2), None, torch.zeros(2), torch.zeros(2, 2), torch.zeros(2, 1, dtype=torch.long),
                   index=i, last=i == n - 1, plan=plan)
        for i in range(n)
    ]  # fmt: skip


def _moved(balancer: MarbleBalancer) -> None:
    state = balancer.state_dict()
    state.update(alpha_bar=[0.9, 0.1], num_refreshes=state["num_refreshes"] + 1)
    balancer.load_state_dict(state)


def test_micro_batches_are_immutable_and_a_replan_swaps_them_in():
    batches = _batches(3)
    session = StepSession(batches, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batches[0].plan = dataclasses.replace(batches[0].plan, mode="plain")
    replanned = [dataclasses.replace(b, plan=dataclasses.replace(b.plan, mode="plain")) for b in batches]
    session.replan(replanned)
    assert [session.batch(i) for i in range(3)] == replanned and session.plan.mode == "plain"
    assert all(b.plan.mode == "solve_first" for b in batches)  # what the Trainer holds is untouched
    with pytest.raises(ValueError, match="keep its micro-batches"):
        session.replan(replanned[:2])
    with pytest.raises(ValueError, match="numbered 0..n-1"):
        StepSession(batches[1:], None)


@pytest.mark.parametrize("skipped", [True, False])
def test_the_optimizers_verdict_commits_or_rolls_back_the_refresh(skipped):
    balancer = MarbleBalancer(reward_names=["a", "b"])
    before = balancer.state_dict()
    session = StepSession(_batches(2), balancer)
    session.begin_refresh()
    _moved(balancer)
    session.begin_refresh()  # a second pair of the step: the transaction stays where it opened
    _moved(balancer)
    session.end(skipped)
    after = balancer.state_dict()
    assert (after == before) is skipped
    if not skipped:
        assert after["num_refreshes"] == before["num_refreshes"] + 2
    assert session.closed
    with pytest.raises(RuntimeError, match="session is closed"):
        session.batch(0)


def test_training_step_input_must_be_this_steps():
    batches = _batches(2)
    session = StepSession(batches, None)
    replanned = [dataclasses.replace(b, plan=dataclasses.replace(b.plan, mode="plain")) for b in batches]
    session.replan(replanned)
    assert session.batch_for(batches[1]) is replanned[1]  # what the Trainer hands back: the planned object
    assert session.batch_for(replanned[0]) is replanned[0]
    edited = dataclasses.replace(batches[0], last=True)
    with pytest.raises(ValueError, match="start_step"):
        session.batch_for(edited)
    with pytest.raises(ValueError, match="start_step"):
        session.batch_for(_batches(3)[2])
    with pytest.raises(ValueError, match="start_step"):  # another step's micro-batch 0: other tensors, same index
        session.batch_for(_batches(2)[0])


def test_a_step_without_a_refresh_leaves_the_balancer_alone():
    balancer = MarbleBalancer(reward_names=["a", "b"])
    session = StepSession(_batches(1), balancer)
    _moved(balancer)  # an exact refresh at the step's end: after the losses, not a transaction of the session
    moved = balancer.state_dict()
    session.end(skipped=True)
    assert balancer.state_dict() == moved
