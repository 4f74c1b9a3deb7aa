"""The library's compiled CPU passes on torch's intra-op threads.

The exact sampler's runs, the release's grid index and OSO's float64 inner products are loops compiled with numba
that release the GIL (``nogil``). Each splits its work into tasks of a fixed size, and :func:`on_threads` runs them
on as many threads as torch uses for its own operators (``torch.get_num_threads``): the calling thread and helper
threads kept for the process. Which task a thread takes varies from run to run; what a task computes, and where it
writes, does not, so every result is the same on any number of threads.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor


def threads_for(tasks: int) -> int:
    """How many threads to run ``tasks`` tasks on: torch's intra-op threads, but no more than there are tasks (a
    helper thread for a further task only: a small model's work takes less time than handing it to a thread)."""
    return max(1, min(torch.get_num_threads(), tasks))


def on_threads(threads: int, work: Callable[[], None]) -> None:
    """Runs ``work`` on ``threads`` threads at once, the calling thread one of them (the others from :func:`pool`),
    and returns when all are done, re-raising a helper's error. ``work`` takes its share itself (a shared counter)."""
    helpers = [pool(threads - 1).submit(work) for _ in range(threads - 1)] if threads > 1 else []
    work()  # the calling thread works too
    for done in helpers:
        done.result()  # re-raises a helper's error


def run_tasks(tasks: int, task: Callable[[int], None], threads: int | None = None) -> None:
    """Runs ``task(k)`` for ``k`` in ``range(tasks)``, each once, on ``threads`` threads (:func:`threads_for` the
    tasks unless given), each thread taking the next task not yet taken."""
    claims = itertools.count()  # the next task not yet taken (next() on it is atomic under the GIL)

    def work() -> None:
        while (k := next(claims)) < tasks:
            task(k)

    on_threads(threads_for(tasks) if threads is None else threads, work)


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, threads, pool)


def pool(threads: int) -> ThreadPoolExecutor:
    """The helper threads: at least ``threads`` of them, made once per process (a forked child makes its own)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < threads:
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[2].shutdown(wait=False)  # too small: its idle threads end, the larger pool replaces it
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="lightning_oso-cpu"))
    return _POOL[2]


def as_numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor's values as a C-contiguous numpy array, sharing its memory where it already is contiguous."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return np.ascontiguousarray(tensor.numpy())
