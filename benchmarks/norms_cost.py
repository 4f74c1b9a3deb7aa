"""Cost of the fast path's per-sample norms: ``BookKeeping`` on the models of ``overhead.py``.

Per model and batch size, the minimum over repeats (the machine's noise only adds time) of

- ``backward``: forward + backward with the book-keeping hooks (autograd's weight gradients frozen, as the strategy
  runs it), which includes the layer parts computed during backward;
- ``norms``: the ``norms()`` call after it (the per-sample norms of every layer, combined).

``--compare FILE`` measures another version of ``book_keeping.py`` (a self-contained file, e.g. an older one from
``git show REV:lightning_oso/book_keeping.py``) in the same process, interleaved with this one (each repeat runs
both, in alternating order), so that the noise of a shared machine hits both alike::

    git show 642d47f:lightning_oso/book_keeping.py > /tmp/old_book_keeping.py
    PYTHONPATH=. python benchmarks/norms_cost.py --compare /tmp/old_book_keeping.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MODELS, synthetic_data

from lightning_oso.per_sample import BookKeeping


def _load(path: str):
    spec = importlib.util.spec_from_file_location("compared_book_keeping", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BookKeeping


def measure(model_name: str, batch_size: int, repeats: int, versions: dict) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    x, y = synthetic_data(MODELS[model_name], batch_size).tensors
    times = {name: {"backward": [], "norms": []} for name in versions}
    names = list(versions)
    for i in range(repeats + 2):
        for name in names if i % 2 else names[::-1]:
            bk = versions[name](model, loss_reduction="mean")
            bk.freeze()
            start = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            bk.unfreeze()
            mid = time.perf_counter()
            bk.norms()
            end = time.perf_counter()
            bk.remove()
            if i >= 2:  # warm-up
                times[name]["backward"].append(mid - start)
                times[name]["norms"].append(end - mid)
    return {name: {k: 1e3 * min(v) for k, v in t.items()} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compare", help="another book_keeping.py to measure alongside")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    # one thread by default: on a shared machine, every op of a 2-thread pool waits for a busy core's time slice
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import lightning_oso

    versions = {"this": BookKeeping}
    if args.compare:
        versions = {"compared": _load(args.compare), "this": BookKeeping}
    print(
        f"package: {Path(lightning_oso.__file__).parent}, torch {torch.__version__}, threads {torch.get_num_threads()}"
        f"{', compared: ' + args.compare if args.compare else ''}; minimum of {args.repeats} repeats, ms"
    )
    header = " | ".join(f"{name} {what}" for name in versions for what in ("fwd+bwd", "norms()"))
    print(f"| model | B | {header} |")
    print("| --- | --- |" + " --- |" * (2 * len(versions)))
    for name in args.models:
        for batch_size in args.batch_sizes:
            r = measure(name, batch_size, args.repeats, versions)
            cells = " | ".join(f"{r[v]['backward']:.2f} | {r[v]['norms']:.2f}" for v in versions)
            print(f"| {name} | {batch_size} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
