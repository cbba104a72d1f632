"""One pass over a split: batches staged ahead on background threads, taken in order.

:meth:`fastopt.runtime.Loader.epoch` returns an :class:`EpochStream`; the loader samples and
stages each batch, this module decides which thread does it and when. With SlimCache,
:class:`_CachePlanner` samples batches ahead of staging and announces their cached ids to the
``future`` policy.

Layering: imports nothing of fastopt but :mod:`fastopt.errors` and :mod:`fastopt.runtime.timing`
(the loader is passed in).
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import TYPE_CHECKING, Iterator, List, Optional

from fastopt.errors import ConfigError
from fastopt.runtime.timing import StageTimer

if TYPE_CHECKING:
    from fastopt.runtime.loader import EventBatch, Loader

__all__ = ["EpochStream", "stage_workers"]

# Seconds between checks of the stop flag while a producer waits (for room in its queue, for
# its turn to sample).
_POLL = 0.05
# Staged lookups SlimCache keeps per table (slimcache._MAX_PENDING): batches staged ahead of the
# consumer with the cache on.
_CACHE_STAGED = 2


def stage_workers(stage_threads: int, depth: int, cuda: bool) -> int:
    """Threads that stage an epoch's batches for ``pipeline.stage_threads`` and a prefetch depth
    of ``depth``: 0 = 2 on CUDA, 1 on the CPU (there a batch has no copies to overlap with the
    next one's sampling, which runs one call at a time, and a second thread would take a core
    from the step); never more than the batches staged ahead."""
    return max(1, min(stage_threads or (2 if cuda else 1), depth))


class _SwitchInterval:
    """The interpreter's thread switch interval while epochs that asked for a shorter one
    (``pipeline.gil_switch_us``) run: the shortest asked for, and the interval from before the
    first of them once the last one ends, in whatever order overlapping epochs end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict = {}  # id(stream) -> seconds
        self._before = 0.0

    def request(self, stream: object, seconds: float) -> None:
        with self._lock:
            if not self._asked:
                self._before = sys.getswitchinterval()
            self._asked[id(stream)] = seconds
            sys.setswitchinterval(min(self._asked.values()))

    def release(self, stream: object) -> None:
        with self._lock:
            if self._asked.pop(id(stream), None) is not None:
                sys.setswitchinterval(min(self._asked.values()) if self._asked else self._before)


_SWITCH = _SwitchInterval()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _CachePlanner:
    """Samples an epoch's batches ahead of staging and announces each one's cached ids to
    SlimCache before the batch is staged (the ``future`` policy's lookahead).

    :meth:`take` returns batch ``i``, sampled, once batches ``i .. i + lookahead`` have been
    sampled and announced, so the policy knows every row's next use within that window and
    orders the rows beyond it by recency. The first call plans the cache with the first window:
    on the cache's first epoch that also fixes the budget split and ``auto``'s choice, from the
    leading ``cache.sample_fraction`` of the window. Sampling ahead keeps the batches' order, so
    the draws and the lookups are those of a loader that does not look ahead.
    """

    def __init__(self, loader: Loader, plan: List[Optional[EventBatch]], lookahead: int) -> None:
        self.loader, self.plan, self.lookahead = loader, plan, max(0, lookahead)
        self.sampled = 0  # batches sampled (and announced) so far
        self.planned = False

    def take(self, i: int) -> EventBatch:
        end = min(i + self.lookahead + 1, len(self.plan))
        fresh = []
        while self.sampled < end:
            batch = self.plan[self.sampled]
            self.loader.sample(batch)
            ids = self.loader.cache_ids(batch)
            if ids is not None:
                fresh.append(ids)
                batch.announced = True
            self.sampled += 1
        if not self.planned:
            # a new epoch of the future policy; a static hot set installs the split's
            self.loader.cache.plan(fresh, split=next((b.split for b in self.plan if b is not None), ""))
            self.planned = True
        else:
            for ids in fresh:
                self.loader.cache.announce(ids)
        # the plan lets go of a batch once it is staged (see EpochStream._produce)
        batch, self.plan[i] = self.plan[i], None
        return batch


class EpochStream:
    """Staged batches of one pass, produced ahead on background threads when the pipeline asks.

    ``pipeline.stage_threads`` threads stage whole batches in turn (thread ``w`` batches ``w``,
    ``w + n``, ...) and the consumer takes them in order: the compiled sampler runs one call at a
    time, but a batch's packing and copies overlap the next one's sampling. Uniform draws are
    keyed by the batch, and the threads sample in the batches' order, each batch's padded
    lengths reserved as it is sampled (:meth:`~fastopt.runtime.Loader.reserve`), so the
    batches, their shapes included, are the same for any number of threads and any timing.

    With SlimCache's staged lookups one thread stages the batches in order, at most two of them
    ahead of the consumer (the cache's limit of staged lookups), and batches are sampled
    ``pipeline.prefetch_depth`` further ahead than they are staged, their cached ids announced to
    the cache's ``future`` policy (:class:`_CachePlanner`; 0 without ``pipeline.async_sampling``).
    Zero-copy reads (``Loader.zero_copy``) need none of that: the batches are staged as with
    device tables, once the epoch has installed ``split``'s hot set (while the staging threads
    sample the first batches; :meth:`~fastopt.runtime.Loader.begin_epoch`).

    Use as ``with loader.epoch(...) as batches: for batch in batches: ...``; leaving the block
    stops and joins the producer (and finishes the cache lookups of batches staged but never
    consumed). The time the consumer waits for a batch is the ``sample`` stage; making a staged
    batch usable on the compute stream is ``gather``.
    """

    def __init__(self, loader: Loader, batches: Iterator[EventBatch], timer: StageTimer,
                 split: str = "") -> None:
        self.loader, self.timer = loader, timer
        self._batches = batches
        pipe = loader.config.pipeline
        depth = pipe.prefetch_depth if pipe.async_sampling else 0
        workers = stage_workers(pipe.stage_threads, depth, loader.cuda)
        self._lookahead = 0
        self._room: Optional[threading.Semaphore] = None
        self._planner: Optional[_CachePlanner] = None
        self._staged_cache = loader.cache is not None and not loader.zero_copy
        self._split = split
        # zero-copy reads: staging waits for the split's hot set, installed while the first
        # batches are sampled (__enter__); set at once otherwise
        self._cache_ready = threading.Event()
        if not loader.zero_copy:
            self._cache_ready.set()
        if self._staged_cache:
            self._lookahead = depth  # batches sampled and announced beyond the one staged
            depth = min(depth, 1)  # SlimCache keeps at most two staged lookups per table
            workers = 1  # and its lookups go in batch order
            # staged batches not yet finished by the consumer: SlimCache's limit, and the staging
            # buffer of the oldest one is refilled only once it is finished
            self._room = threading.Semaphore(_CACHE_STAGED)
        if loader.sampler is not None and not loader.keyed:
            workers = 1  # draws keyed by the order of calls: one thread keeps them reproducible
        self.depth = depth
        if depth == 0:
            self._begin_cache()
        self.workers = workers
        self._queues: List["queue.Queue"] = [queue.Queue(maxsize=max(1, depth // self.workers))
                                             for _ in range(self.workers)]
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._turn = threading.Condition()  # batches sample (and reserve) in order: _in_turn
        self._next = 0  # the batch whose turn it is

    def __enter__(self) -> "EpochStream":
        if self.depth > 0:
            try:
                self._plan = list(self._batches)
                self._count = len(self._plan)
                if self._room is not None:
                    self._planner = _CachePlanner(self.loader, self._plan, self._lookahead)
                for w in range(self.workers):
                    thread = threading.Thread(target=self._produce, args=(w, self._queues[w]),
                                              name=f"fastopt-loader-{w}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
                switch_us = self.loader.config.pipeline.gil_switch_us
                if switch_us:  # the training thread takes the GIL back sooner from the staging threads
                    _SWITCH.request(self, switch_us / 1e6)
                self._begin_cache()
            except BaseException:  # no `with` block runs __exit__ then: stop what started
                self.close()
                raise
        return self

    def _begin_cache(self) -> None:
        if not self._cache_ready.is_set():
            self.loader.begin_epoch(self._split)
            self._cache_ready.set()

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Stop the producers and wait for them (idempotent)."""
        self._stop.set()
        for thread, q in zip(self._threads, self._queues):
            while thread.is_alive():
                try:  # make room so a producer blocked on put() sees the flag
                    q.get_nowait()
                except queue.Empty:
                    pass
                thread.join(timeout=_POLL)
        self._threads = []
        _SWITCH.release(self)
        if self.loader.cache is not None:  # batches staged but never consumed
            self.loader.cache.drain()

    def _produce(self, worker: int, q: "queue.Queue") -> None:
        try:
            for i in range(worker, self._count, self.workers):
                if self._stop.is_set():
                    return
                if self._planner is not None:
                    batch = self._planner.take(i)
                    if not self._wait_for_room():
                        return
                else:
                    # the plan lets go of a batch once it is staged: a staged batch holds its
                    # inputs on the device, which must be freed when the consumer is done with
                    # it, not at the end of the epoch
                    batch, self._plan[i] = self._plan[i], None
                    if not self._in_turn(i, batch) or not self._wait(self._cache_ready):
                        return
                self._put(q, self.loader.stage(batch))
                del batch
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(q, _Failure(exc))

    def _in_turn(self, i: int, batch: EventBatch) -> bool:
        """Sample batch ``i`` and reserve its padded lengths once batch ``i - 1`` has (its turn
        passes on even when that fails); False once stopped."""
        with self._turn:
            while self._next != i:
                if self._stop.is_set():
                    return False
                self._turn.wait(_POLL)
        try:
            self.loader.sample(batch)
            self.loader.reserve(batch)
        finally:
            with self._turn:
                self._next = i + 1
                self._turn.notify_all()
        return True

    def _wait(self, event: threading.Event) -> bool:
        """Wait for ``event``; False once stopped."""
        while not event.wait(_POLL):
            if self._stop.is_set():
                return False
        return True

    def _wait_for_room(self) -> bool:
        """Wait until fewer than two staged batches await the consumer; False once stopped."""
        while not self._stop.is_set():
            if self._room.acquire(timeout=_POLL):
                return True
        return False

    def _put(self, q: "queue.Queue", item) -> None:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[EventBatch]:
        if self.depth == 0:
            planner = None
            if self._staged_cache:
                plan = list(self._batches)
                planner = _CachePlanner(self.loader, plan, self._lookahead)
                self._batches = iter(plan)  # taken by the planner, in order
            for i, batch in enumerate(self._batches):
                with self.timer("sample", host=True):
                    staged = self.loader.stage(batch if planner is None else planner.take(i))
                with self.timer("gather", host=True):
                    yield self.loader.finish(staged)
            return
        if not self._threads:
            raise ConfigError("iterate an epoch inside `with loader.epoch(...) as batches:`")
        for i in range(self._count):  # worker w staged batches w, w + workers, ...: take them in turn
            with self.timer("sample", host=True):
                item = self._queues[i % self.workers].get()
            if isinstance(item, _Failure):
                raise item.exc
            with self.timer("gather", host=True):
                batch = self.loader.finish(item)
            if self._room is not None:
                self._room.release()
            yield batch
