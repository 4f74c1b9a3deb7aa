"""Synthetic batches with the structure of a training batch and none of its values, for the consistency checks
(``checks.py``): what they learn from a run must not depend on any record.

:func:`synthetic_batch` builds one; :func:`batch_and_leave_one_out` builds it and the same batch without its first
record, either by slicing the batch (tensors, arrays, mappings and sequences of them) or, given the loader's
``collate_fn``, by collating the records again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

#: Seed of the synthetic values: fixed and data-independent, so every process checks the same batch.
SEED = 0


def synthetic_batch(
    example: Any, size: int, generator: torch.Generator | None = None, collate: Callable | None = None
) -> Any:
    """A batch of ``size`` synthetic records with the structure of ``example``.

    Only the structure, shapes and dtypes of ``example`` are used, never its values: floating tensors are filled with
    N(0, 1) draws from ``generator`` (a fixed, data-independent one by default), integer tensors with 1 (a valid
    class, token id and attention-mask value), bool tensors with True; Python and NumPy scalars and arrays likewise.
    Tuples, lists, named tuples and mappings keep their type, nested or not.

    Args:
        example: a batch (every tensor's dim 0 indexes the records; the others keep their size), e.g. the first
            record of the training dataset as the DataLoader's collate function batches it; or, with ``collate``,
            one record as the dataset returns it.
        size: the number of records.
        generator: the source of the floating values; default ``torch.Generator().manual_seed(SEED)``.
        collate: if given, ``example`` is one record and the batch is ``collate`` of ``size`` synthetic records,
            laid out as the DataLoader would lay out real ones (time-major, padded, ... as its collate function does).

    Raises:
        ValueError: for a leaf that has no synthetic stand-in (a string, an arbitrary object).
    """
    generator = generator if generator is not None else torch.Generator().manual_seed(SEED)
    if collate is not None:
        return collate([_synthetic(example, generator, None) for _ in range(size)])
    return _synthetic(example, generator, size)


def _synthetic(x: Any, generator: torch.Generator, size: int | None) -> Any:
    if isinstance(x, Tensor):
        shape = (size, *x.shape[1:]) if size is not None and x.dim() else tuple(x.shape)
        return _fill(shape, x.dtype, generator).to(x.device)
    if isinstance(x, (bool, int, float)) or _is_numpy(x):
        return _synthetic_scalar_or_array(x, generator, size)
    if x is None:
        return None
    if isinstance(x, Mapping):
        items = {key: _synthetic(value, generator, size) for key, value in x.items()}
        try:
            return type(x)(items)  # type: ignore[call-arg]  # the batch's own mapping type, if it takes a dict
        except TypeError:
            return items
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(_synthetic(value, generator, size) for value in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_synthetic(value, generator, size) for value in x)
    raise ValueError(f"the training records hold a {type(x).__name__}, which has no synthetic stand-in")


def _fill(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    if dtype.is_floating_point or dtype.is_complex:
        draw_dtype = torch.complex64 if dtype.is_complex else torch.float32
        return torch.randn(shape, generator=generator, dtype=draw_dtype).to(dtype)
    return torch.ones(shape, dtype=dtype)


def _is_numpy(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape")


def _synthetic_scalar_or_array(x: Any, generator: torch.Generator, size: int | None) -> Any:
    if isinstance(x, bool):
        return True
    if isinstance(x, int):
        return 1
    if isinstance(x, float):
        return float(torch.randn((), generator=generator, dtype=torch.float64))
    import numpy as np

    shape = (size, *x.shape[1:]) if size is not None and x.ndim else tuple(x.shape)
    if x.dtype.kind in "fc":
        value = torch.randn(shape, generator=generator, dtype=torch.float64).numpy().astype(x.dtype)
    elif x.dtype.kind in "biu":
        value = np.ones(shape, dtype=x.dtype)
    else:
        raise ValueError(f"the training records hold a NumPy array of dtype {x.dtype}, which has no synthetic stand-in")
    return value if isinstance(x, np.ndarray) else value[()]  # a NumPy scalar stays one


def _drop_first(batch: Any) -> Any:
    """``batch`` without record 0: every tensor (and array) with a dim 0 loses its first row."""
    if isinstance(batch, Tensor) or _is_numpy(batch):
        return batch[1:] if batch.ndim else batch
    if isinstance(batch, Mapping):
        items = {key: _drop_first(value) for key, value in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # the batch's own mapping type, if it takes a dict
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_drop_first(value) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_drop_first(value) for value in batch)
    return batch


def batch_and_leave_one_out(example: Any, size: int, collate: Callable | None) -> tuple[Any, Any]:
    """The synthetic batch and the same batch without its record 0."""
    generator = torch.Generator().manual_seed(SEED)
    if collate is None:
        full = synthetic_batch(example, size, generator)
        return full, _drop_first(full)
    records = [_synthetic(example, generator, None) for _ in range(size)]
    return collate(records), collate(records[1:])
