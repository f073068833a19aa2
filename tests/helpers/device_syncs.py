"""Record, during the epochs of a run, every call in bnsgcn's own code that reads a tensor's
data on the host: on CUDA each such call on a device tensor waits for the device.

:func:`instrument` is handed to :func:`tests.helpers.ranks.run_ranks`: inside each rank it
wraps ``bnsgcn.run.train._train`` in a :class:`torch.overrides.TorchFunctionMode` that records
from the first training epoch until the report is written. A call is named by where it is
made, ``module.function:operation`` (``exchange.exchange_selections:cpu``); calls made
inside torch itself (the optimizer, say) are not the engine's and are left to
``torch.cuda.set_sync_debug_mode`` on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import bnsgcn

ENGINE = Path(bnsgcn.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
# torch's Python wrappers around tensor methods: look past them for the caller
_WRAPPERS = {str(TORCH / "_tensor.py"), str(TORCH / "functional.py"), str(TORCH / "overrides.py")}

# reads of data on the host, whatever their arguments; blocking copies to the device (which
# wait for its queue too) are recorded below
_ALWAYS = {
    "item",
    "tolist",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "numpy",
    "cpu",
    "masked_select",
    "bincount",
    "unique",
    "unique_consecutive",
    "argwhere",
}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _reads_data(name: str, args: tuple, kwargs: dict) -> bool:
    """True for an operation whose result's shape or value needs the data on the host."""
    if name in _ALWAYS:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        return len(args) > 1 and _bool_index(args[1])
    if name == "repeat_interleave":  # without output_size the length is data
        return "output_size" not in kwargs
    if name in ("to", "cuda"):  # a blocking copy between devices (to the GPU there, when not to "cpu")
        devices = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
        return (name == "cuda" or bool(devices)) and not kwargs.get("non_blocking", False)
    if name in ("new_tensor", "tensor", "as_tensor"):  # host data copied into a tensor (on the GPU there)
        return name == "new_tensor" or kwargs.get("device") is not None
    return False


class SyncRecorder(TorchFunctionMode):
    """Counts host reads per call site while :attr:`recording`."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.sites: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recording:
            name = getattr(func, "__name__", "")
            if _reads_data(name, args, kwargs):
                site = _site(sys._getframe(1))
                if site is not None:
                    self.sites[f"{site}:{name}"] = self.sites.get(f"{site}:{name}", 0) + 1
        return func(*args, **kwargs)


def _site(frame) -> str | None:
    """``module.function`` of the engine's code making the call, or None outside the engine."""
    while frame is not None and frame.f_code.co_filename in _WRAPPERS:
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    if ENGINE not in path.parents:
        return None
    module = ".".join(path.relative_to(ENGINE).with_suffix("").parts)
    return f"{module}.{frame.f_code.co_qualname}"


def _during_epochs(start, stop, around=None):
    """Patch ``bnsgcn.run.train`` in this rank: ``start()`` before the first epoch of the next
    run, ``stop()`` when its report begins (``_finish``), and the whole of ``_train`` inside
    the context manager ``around`` when given. Returns the function that undoes the patch."""
    from bnsgcn.run import train

    original = train._train, train._train_epoch, train._finish
    started = [False]

    def _train(*args, **kwargs):
        if around is None:
            return original[0](*args, **kwargs)
        with around:
            return original[0](*args, **kwargs)

    def _train_epoch(*args, **kwargs):
        if not started[0]:  # from the first epoch on: the loop, evaluation, accounting
            started[0] = True
            start()
        return original[1](*args, **kwargs)

    def _finish(*args, **kwargs):
        stop()  # the report and the summary are not an epoch's
        return original[2](*args, **kwargs)

    train._train, train._train_epoch, train._finish = _train, _train_epoch, _finish

    def restore() -> None:
        train._train, train._train_epoch, train._finish = original

    return restore


def instrument():
    """In a rank: record the host reads of every epoch of the next run; returns the collector."""
    recorder = SyncRecorder()
    restore = _during_epochs(
        lambda: setattr(recorder, "recording", True), lambda: setattr(recorder, "recording", False), around=recorder
    )

    def collect() -> dict[str, int]:
        restore()
        return dict(recorder.sites)

    return collect


def instrument_cuda_syncs():
    """In a rank on CUDA: every synchronising CUDA operation torch reports
    (``torch.cuda.set_sync_debug_mode("warn")``) during the epochs of the next run, named by
    the innermost engine function on the stack and the warning's first words."""
    import warnings

    sites: dict[str, int] = {}
    recording = [False]
    original_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        # torch's words for a synchronising operation (not its notice that the debug mode
        # is a prototype, given when the mode is switched on)
        if recording[0] and "called a synchronizing CUDA operation" in text:
            frame = sys._getframe(1)
            while frame is not None and _site(frame) is None:
                frame = frame.f_back
            site = f"{_site(frame) if frame is not None else 'outside the engine'}:{text.split(',')[0][:60]}"
            sites[site] = sites.get(site, 0) + 1
        else:
            original_show(message, category, filename, lineno, file, line)

    def start() -> None:
        recording[0] = True
        torch.cuda.set_sync_debug_mode("warn")

    def stop() -> None:
        recording[0] = False
        torch.cuda.set_sync_debug_mode("default")

    warnings.simplefilter("always")
    warnings.showwarning = show
    restore = _during_epochs(start, stop)

    def collect() -> dict[str, int]:
        restore()
        warnings.showwarning = original_show
        return dict(sites)

    return collect
