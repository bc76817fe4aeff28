"""The controller's round timing: it goes on the moment the last result is processed (not at FLARE's next poll),
keeps broadcast_and_wait's straggler rules, does the previous round's bookkeeping after the next task is out, and
holds a site's request for its next task while the server is between phases (instead of FLARE's "try again").
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
from nvflare.apis.controller_spec import TaskCompletionStatus
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal

from medflare.flare.controller import MedflareController, NextTaskHold, PhaseAnswers
from medflare.methods.base import PerSite, RoundContext, Stage

from .._plans import site_data_plan

# Every wait below ends on an event; its bound is half the time the wait would last without that event (the poll
# period, a hold's limit, a straggler's deadline), far from it on a machine busy with other work.
SLOW_POLL = 10.0  # a poll period far longer than any wait below: only the result callback's event can be in time
HOLD_LIMIT = 10.0  # a hold's limit far longer than any wait below: only the next task can end the hold in time


def controller(min_clients: int = 2, wait_after_min: int = 600) -> MedflareController:
    plan = site_data_plan(rounds=2, clients=max(min_clients, 2), min_clients=min_clients,
                          straggler_seconds=wait_after_min)
    ctl = MedflareController().use_plan(plan)
    ctl._task_check_period = SLOW_POLL
    # what FLARE's WFCommServer.cancel_task does (no engine here): mark the task; its monitor drops it later
    ctl.cancel_task = lambda task, completion_status, fl_ctx: setattr(task, "completion_status", completion_status)
    return ctl


def tasks_for(*sites: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(targets=[site], completion_status=None) for site in sites]


def answer_later(answers: PhaseAnswers, site: str, after: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(after), answers.add(site)))
    thread.start()
    return thread


def test_the_wait_ends_when_the_last_result_is_processed_not_at_the_next_poll() -> None:
    ctl, answers, tasks = controller(), PhaseAnswers(), tasks_for("site-1", "site-2")
    answers.add("site-1")
    started = time.monotonic()  # before the answering thread starts its sleep, so the wait cannot look shorter
    answer_later(answers, "site-2", after=0.3)
    ctl._wait_for_answers(tasks, answers, Signal(), FLContext())
    waited = time.monotonic() - started
    assert 0.3 <= waited < SLOW_POLL / 2, f"waited {waited:.2f} s for a result that came after 0.3 s (poll {SLOW_POLL} s)"
    assert [t.completion_status for t in tasks] == [TaskCompletionStatus.OK] * 2


def test_stragglers_get_wait_time_after_min_received_then_their_task_is_cancelled() -> None:
    ctl = controller(min_clients=1, wait_after_min=1)
    answers, tasks = PhaseAnswers(), tasks_for("site-1", "site-2")
    answers.add("site-1")
    started = time.monotonic()
    ctl._task_check_period = 0.05
    ctl._wait_for_answers(tasks, answers, Signal(), FLContext())
    waited = time.monotonic() - started
    assert 1.0 <= waited < 1.0 + SLOW_POLL / 2  # without the deadline it would wait for site-2, which never answers
    assert [t.completion_status for t in tasks] == [TaskCompletionStatus.CANCELLED] * 2  # site-2 never answered


def test_a_task_flare_ended_itself_counts_as_answered() -> None:
    ctl, answers, tasks = controller(), PhaseAnswers(), tasks_for("site-1")
    tasks[0].completion_status = TaskCompletionStatus.TIMEOUT
    started = time.monotonic()
    ctl._wait_for_answers(tasks, answers, Signal(), FLContext())
    assert time.monotonic() - started < SLOW_POLL / 2 and tasks[0].completion_status == TaskCompletionStatus.TIMEOUT


def test_an_abort_ends_the_wait_and_cancels_the_tasks() -> None:
    ctl, answers, tasks = controller(), PhaseAnswers(), tasks_for("site-1", "site-2")
    abort = Signal()
    threading.Thread(target=lambda: (time.sleep(0.2), abort.trigger(True), answers.wake.set())).start()
    ctl._wait_for_answers(tasks, answers, abort, FLContext())
    assert [t.completion_status for t in tasks] == [TaskCompletionStatus.CANCELLED] * 2


def test_the_previous_rounds_bookkeeping_runs_after_the_next_task_is_sent_and_only_once() -> None:
    ctl, order = controller(), []
    ctl.aggregator = SimpleNamespace(holds_plaintext=True, core=SimpleNamespace(task_header=lambda: {}))
    ctl.broadcast = lambda task, fl_ctx, **kw: order.append(("broadcast", tuple(kw.get("targets") or ())))
    ctl._wait_for_answers = lambda tasks, answers, abort, fl_ctx: order.append(("wait", len(tasks)))
    ctl._housekeeping = lambda: order.append(("bookkeeping", ()))
    ctx = RoundContext(round=1, total_rounds=2)
    per_site = PerSite({"site-2": {"w": np.zeros(2)}, "site-1": {"w": np.ones(2)}})
    for outgoing in (per_site, {"w": np.zeros(2)}):
        ctl._send_phase("train", outgoing, ctx, {}, {}, Signal(), FLContext())
    assert order == [("broadcast", ("site-1",)), ("broadcast", ("site-2",)), ("bookkeeping", ()), ("wait", 2),
                     ("broadcast", ()), ("wait", 1)]


def test_the_last_rounds_bookkeeping_runs_before_the_job_ends() -> None:
    ctl, done = controller(), []
    ctl.aggregator = SimpleNamespace(method="fedavg", holds_plaintext=True, core=SimpleNamespace(stages=[]))
    ctl.results.data = {"rounds": []}
    ctl.persistor = SimpleNamespace(save=lambda learnable, fl_ctx: done.append("model"))
    ctl.global_params = {}

    def run_round(ctx: RoundContext, abort: Signal, fl_ctx: FLContext) -> None:
        ctl._run_housekeeping()  # what the round's _send_phase does once its task is out
        ctl._housekeeping = lambda: done.append(ctx.round)

    ctl._run_round = run_round
    ctl._final_validation = lambda last, abort, fl_ctx: done.append("final")
    ctl._write_results = lambda: None
    ctl.aggregator.core.stages = [Stage("train", 2)]
    ctl.control_flow(Signal(), FLContext())
    assert done == [0, 1, "model", "final"]


# ----- a site's request for its next task, held while the server is between phases ------------------------------
def task_request_from(site: str) -> FLContext:
    """The FLContext FLARE's server runner fires BEFORE_PROCESS_TASK_REQUEST with: the asking site as its peer."""
    peer = FLContext()
    peer.put(key=ReservedKey.IDENTITY_NAME, value=site, private=False, sticky=False)
    ctx = FLContext()
    ctx.set_peer_context(peer)
    return ctx


def ask_for_task(ctl: MedflareController, site: str, waited: list[float]) -> threading.Thread:
    def ask() -> None:
        started = time.monotonic()
        ctl.handle_event(EventType.BEFORE_PROCESS_TASK_REQUEST, task_request_from(site))
        waited.append(time.monotonic() - started)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_a_hold_ends_when_the_next_task_is_out() -> None:
    hold = NextTaskHold(limit=HOLD_LIMIT)
    hold.between_phases({"site-1"})
    started = time.monotonic()
    threading.Thread(target=lambda: (time.sleep(0.3), hold.task_out())).start()
    waited = hold.hold("site-1")
    assert 0.28 <= waited < HOLD_LIMIT / 2 and time.monotonic() - started < HOLD_LIMIT / 2, waited


def test_no_hold_while_a_task_is_out_or_for_a_site_that_did_not_answer() -> None:
    hold = NextTaskHold(limit=HOLD_LIMIT)
    assert hold.hold("site-1") == 0.0  # before any phase ended: a task may be out, nothing to wait for
    hold.between_phases({"site-1"})
    assert hold.hold("site-2") == 0.0 and hold.hold(None) == 0.0  # not among the phase's answers
    hold.task_out()
    assert hold.hold("site-1") == 0.0


def test_a_hold_never_outlasts_its_limit() -> None:
    hold = NextTaskHold(limit=0.3)
    hold.between_phases({"site-1"})
    waited = hold.hold("site-1")
    assert 0.28 <= waited < HOLD_LIMIT / 2, waited  # without the limit it would wait for a task that never comes


def test_the_controller_holds_an_answered_sites_request_until_its_next_task_is_broadcast() -> None:
    ctl, answers, tasks = controller(), PhaseAnswers(), tasks_for("site-1", "site-2")
    ctl.aggregator = SimpleNamespace(holds_plaintext=True, core=SimpleNamespace(task_header=lambda: {}))
    answers.add("site-1")
    answers.add("site-2")
    ctl._next_task = NextTaskHold(limit=HOLD_LIMIT)  # only the broadcast can release site-1 within the bounds below
    ctl._wait_for_answers(tasks, answers, Signal(), FLContext())  # the phase is over: the server works
    waited: list[float] = []
    asking = [ask_for_task(ctl, "site-1", waited), ask_for_task(ctl, "outsider", waited)]
    asking[1].join(timeout=HOLD_LIMIT / 2)
    assert not asking[1].is_alive() and asking[0].is_alive()  # the outsider was answered at once; site-1 is held
    broadcast_at = []
    ctl.broadcast = lambda task, fl_ctx, **kw: broadcast_at.append(time.monotonic())
    ctl._wait_for_answers = lambda tasks, answers, abort, fl_ctx: None
    ctl._send_phase("train", {"w": np.zeros(2)}, RoundContext(round=1, total_rounds=2), {}, {}, Signal(), FLContext())
    asking[0].join(timeout=HOLD_LIMIT)
    assert len(waited) == 2 and waited[1] < HOLD_LIMIT / 2, waited  # released by the broadcast, not by the limit


def test_an_aborted_phase_holds_nobody() -> None:
    ctl, answers, tasks = controller(), PhaseAnswers(), tasks_for("site-1")
    answers.add("site-1")
    abort = Signal()
    abort.trigger(True)
    ctl._wait_for_answers(tasks, answers, abort, FLContext())
    assert ctl._next_task.hold("site-1") == 0.0


def test_the_end_of_the_job_releases_a_held_request() -> None:
    ctl = controller()
    ctl.aggregator = SimpleNamespace(method="fedavg", holds_plaintext=True, core=SimpleNamespace(stages=[]))
    ctl.results.data = {"rounds": []}
    ctl.persistor = SimpleNamespace(save=lambda learnable, fl_ctx: None)
    ctl.global_params = {}
    ctl._run_round = lambda ctx, abort, fl_ctx: ctl._next_task.between_phases({"site-1"})
    ctl._final_validation = lambda last, abort, fl_ctx: None
    ctl._write_results = lambda: None
    ctl.aggregator.core.stages = [Stage("train", 1)]
    ctl.control_flow(Signal(), FLContext())
    assert ctl._next_task.hold("site-1") == 0.0
