"""A parameter-server run of a given length, simulated exchange by exchange.

The steady state (:mod:`~lightning_parallel.plan.parameter_server`) gives each worker's step;
what a *run* sends also depends on how it ends. A remote worker's exchange on a slow link can
last as long as the whole run of the fast worker beside the server (a 20-step run of
``vgg_mini`` at 100 Mbit/s holds two of them), so the counts, not the rates, decide the
bytes: which of its batches the remote worker still trains when the epoch's pool runs dry,
and the replies (each carries the weights) that end an epoch.

:func:`simulate_run` replays the run on a simulated clock with the library's own
:class:`~lightning_parallel.parameter_server.budget.EpochBudget` deciding every grant, and
workers that follow the client's protocol
(:class:`~lightning_parallel.parameter_server.client.ParameterClient` under Lightning, which
fetches one batch ahead):

1. an epoch begins with a ``BEGIN`` exchange (the reply grants batches; all but one may be
   lent to faster workers before the worker speaks again, as after any request);
2. fetching a batch reserves a granted one; with none left to reserve the worker first asks
   for more (a ``CLAIM`` exchange), and a worker told the epoch is over stops fetching: the
   batch before is its last;
3. a batch spends its grant as it starts; a worker whose grant went to a faster worker meanwhile
   skips the batch (the bench still counts a step);
4. a trained batch ends with the gradient pushed and the weights pulled (``want`` batches
   asked for, ``held`` the granted ones not started); the last batch of the epoch carries the
   drain, whose reply waits until every worker drained; a worker whose last batch was skipped
   drains with an exchange of its own;
5. after a drain the next epoch begins, unless the run's limit was reached; where the run
   validates every epoch (the bench does), the workers meet first: validation ends with a
   collective (the logged values' ``sync_dist``), so every worker begins the next epoch once
   the slowest one has its drain's reply (without it a fast worker would take the next
   epoch's batches alone while a remote one still waits for its reply: ``vgg_mini`` at
   100 Mbit/s simulated 16 remote steps in 135 s where the run took 4 in 40 s).

A worker's ``seconds`` are its steps' time, as the bench counts it: the begin exchanges (in
the data loader, before the epoch's first step) and the waits at the meeting are left out.

Every reply carries the weights, every pushed gradient the gradient: the bench's interface
counters see one parameter vector for each, on the server's host and the worker's. The first
epoch's ``BEGIN`` precedes the bench's counting window (measured: its reply is not in the
counters), so it is not counted, and training starts once every worker has its reply: traced
in four runs (the client's requests and replies timed), rank 0's first step waited for the
remote worker's first reply, 0.44 s (``gpt`` at 10 Mbit/s) to 4.3 s (``vgg_mini`` at
100 Mbit/s). Before, the simulation started everyone at once, which let the remote worker's
first gradient reach the server 3 to 4 s early, while rank 0 still had batches to take.

Each worker's steps are logged (seconds, trained or skipped), so the run's samples per second
are counted as the bench counts them: each rank's steps after its first ``warmup_steps``.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from lightning_parallel.parameter_server.budget import EpochBudget
from lightning_parallel.parameter_server.protocol import ReplyFlag

__all__: list[str] = []


@dataclass(frozen=True)
class WorkerTimes:
    """One worker's simulated durations, in seconds.

    Attributes:
        compute_s: a batch, from its start to its request leaving.
        push_s: a request with a gradient, to the server.
        reply_s: from the server's decision to the reply's arrival (apply and weights).
        ask_s: a request without a gradient, to the server.
        fetch_s: a reply without an update, from the decision to its arrival (the weights).
    """

    compute_s: float
    push_s: float = 0.0
    reply_s: float = 0.0
    ask_s: float = 0.0
    fetch_s: float = 0.0


@dataclass
class RunCounts:
    """What each worker did in the run (by worker index).

    Attributes:
        steps: steps the bench counts (trained and skipped batches).
        pushes: gradients sent (the batches it trained).
        replies: replies received inside the bench's counting window.
        seconds: the time of its steps: its clock when it stopped less the begin exchanges
            and the epochs' meetings (the waits at the drains are in its last steps).
        step_log: per worker, each step's seconds and whether it trained its batch.
    """

    steps: list[int]
    pushes: list[int]
    replies: list[int]
    seconds: list[float] = field(default_factory=list)
    step_log: list[list[tuple[float, bool]]] = field(default_factory=list)

    def samples_per_s(self, batch_size: int, warmup_steps: int = 0) -> float:
        """Samples the workers trained per second of their own steps, summed over the workers,
        as the bench counts them: each worker's steps after its first ``warmup_steps`` (at
        most all but one of worker 0's), so a remote worker with no more steps than that
        counts nothing (``vgg_mini`` at 100 Mbit/s: 4 remote steps in a 40-step run)."""
        if not self.step_log or not warmup_steps:
            return sum(
                batch_size * trained / seconds
                for trained, seconds in zip(self.pushes, self.seconds)
                if seconds > 0
            )
        skip = min(warmup_steps, max(0, len(self.step_log[0]) - 1))
        total = 0.0
        for log in self.step_log:
            seconds = sum(s for s, _ in log[skip:])
            if seconds > 0:
                total += batch_size * sum(trained for _, trained in log[skip:]) / seconds
        return total


@dataclass(order=True)
class _Request:
    arrives: float
    worker: int
    kind: str = field(compare=False)  # begin, claim, step, drain
    want: int = field(default=0, compare=False)
    held: int = field(default=0, compare=False)
    gradient: bool = field(default=False, compare=False)
    drain: bool = field(default=False, compare=False)
    setup: bool = field(default=False, compare=False)  # the first BEGIN: before training


@dataclass(frozen=True)
class _Reply:
    time: float
    granted: int
    flags: ReplyFlag
    meet: float = 0.0  # after a drain: when every worker has its reply (the epochs meet)


_Protocol = Generator[_Request, _Reply, None]


class _Worker:
    """The client's side of the protocol for one worker (module docstring, steps 1-5)."""

    def __init__(self, index: int, times: WorkerTimes, lookahead: int) -> None:
        self.index, self.times, self.lookahead = index, times, lookahead
        self.now = 0.0
        self.allowance = self.reserved = 0
        self.epoch_over = self.run_over = False
        self.steps = self.pushes = self.replies = 0
        self.counting = False
        self.idle = 0.0  # seconds outside its steps: begin exchanges, the epochs' meetings
        self.meet = 0.0
        self.step_log: list[tuple[float, bool]] = []  # each step's seconds, and trained?

    def _exchange(self, request: _Request) -> Generator[_Request, _Reply, _Reply]:
        reply = yield request
        self.now = reply.time
        self.meet = reply.meet
        self.replies += self.counting
        self.allowance += reply.granted
        self.epoch_over = ReplyFlag.EPOCH_OVER in reply.flags
        self.run_over |= ReplyFlag.RUN_OVER in reply.flags
        return reply

    def _ask(
        self, kind: str, want: int = 0, held: int = 0, drain: bool = False, setup: bool = False
    ) -> _Request:
        """A request without a gradient (``setup``: the first epoch's ``BEGIN``, before
        training starts)."""
        arrives = self.now + self.times.ask_s
        return _Request(arrives, self.index, kind, want, held, drain=drain, setup=setup)

    def _reserve(self) -> Generator[_Request, _Reply, bool]:
        if self.allowance - self.reserved <= 0 and not self.epoch_over:
            want = max(0, self.lookahead - self.allowance)
            yield from self._exchange(self._ask("claim", want=want, held=self.allowance))
        if self.allowance - self.reserved <= 0:
            return False
        self.reserved += 1
        return True

    def run(self) -> _Protocol:
        while True:
            self.allowance = self.reserved = 0
            self.epoch_over = False
            first = not self.counting
            begin = self._ask("begin", want=self.lookahead, setup=first)
            asked = self.now
            yield from self._exchange(begin)
            self.idle += self.now - asked
            self.counting = True
            current = yield from self._reserve()
            drained = False
            began = self.now  # a step runs from the previous one's end (the epoch's first:
            # after its batch was fetched), the next batch's fetch included
            while current:
                following = yield from self._reserve()
                self.reserved = max(0, self.reserved - 1)
                self.steps += 1
                if self.allowance == 0:
                    current = following  # the grant went to a faster worker: skipped
                    self.step_log.append((self.now - began, False))
                    began = self.now
                    continue
                self.allowance -= 1
                self.now += self.times.compute_s
                self.pushes += 1
                request = _Request(
                    self.now + self.times.push_s,
                    self.index,
                    "step",
                    want=max(0, self.lookahead - self.allowance),
                    held=self.allowance,
                    gradient=True,
                    drain=not following,
                )
                yield from self._exchange(request)
                self.step_log.append((self.now - began, True))
                began = self.now
                drained = not following
                current = following
            if not drained:
                asked = self.now
                yield from self._exchange(self._ask("drain", drain=True))
                self.idle += self.now - asked
            if self.run_over:
                return
            if self.meet > self.now:  # the epochs meet: wait for the slowest drain's reply
                self.idle += self.meet - self.now
                self.now = self.meet


def simulate_run(
    workers: Sequence[WorkerTimes],
    epoch_batches: int | None,
    run_batches: int | None,
    lookahead: int = 2,
    epochs_meet: bool = True,
) -> RunCounts:
    """Replay a run of ``run_batches`` batches in all (``None``: one epoch) whose epochs hold
    ``epoch_batches`` batches per worker; the server is on worker 0's host. ``epochs_meet``:
    the workers meet between epochs (a validation at every epoch's end; step 5 above).

    Raises:
        ValueError: neither a run nor an epoch length is given (the run would not end).
    """
    if epoch_batches is None and run_batches is None:
        raise ValueError("a simulated run needs an epoch length or a run length")
    per_epoch = epoch_batches if epoch_batches is not None else run_batches or 0
    run_limit = run_batches if run_batches is not None else per_epoch * len(workers)
    clock = [0.0]
    budget = EpochBudget(run_limit, clock=lambda: clock[0])
    states = [_Worker(i, t, lookahead) for i, t in enumerate(workers)]
    protocols = [state.run() for state in states]
    queue: list[_Request] = [next(protocol) for protocol in protocols]
    heapq.heapify(queue)
    draining: dict[int, _Request] = {}
    live = set(range(len(workers)))

    def delay(request: _Request) -> float:
        times = workers[request.worker]
        return times.reply_s if request.gradient else times.fetch_s

    # training starts once every worker has its first BEGIN's reply (the fit's start waits
    # for the slowest)
    start = max(t.ask_s + t.fetch_s for t in workers)

    def answer(
        request: _Request, granted: int, flags: ReplyFlag, at: float, meet: float = 0.0
    ) -> None:
        wait = delay(request)
        if request.setup:
            at, wait = start, 0.0
        try:
            following = protocols[request.worker].send(_Reply(at + wait, granted, flags, meet))
        except StopIteration:
            live.discard(request.worker)
            return
        heapq.heappush(queue, following)

    while queue:
        request = heapq.heappop(queue)
        clock[0] = request.arrives
        if request.kind == "begin":
            granted, flags = budget.begin(request.worker, per_epoch, request.want)
        elif request.drain:
            draining[request.worker] = request
            if len(draining) == len(live):
                budget.close_epoch()
                flags = budget.flags()
                at = request.arrives
                meet = max(at + delay(w) for w in draining.values()) if epochs_meet else 0.0
                for waiting in list(draining.values()):
                    answer(waiting, 0, flags, at, meet)
                draining.clear()
            continue
        else:
            granted, flags = budget.grant(request.worker, request.want, request.held)
        answer(request, granted, flags, request.arrives)
    return RunCounts(
        steps=[state.steps for state in states],
        pushes=[state.pushes for state in states],
        replies=[state.replies for state in states],
        seconds=[state.now - state.idle for state in states],
        step_log=[state.step_log for state in states],
    )
