"""A model class of the user's own, ``--model module.path:ClassName``: found, checked, built.

The contract (docs/api.md, "Your own model"): a subclass of ``torch.nn.Module`` whose
constructor takes the keyword arguments :data:`~bnsgcn.config.sections.MODEL_ARGUMENTS`
(``in_channels``, ``hidden_channels``, ``out_channels``, ``num_layers``, ``dropout``: PyG's
names) and those of ``--model-options``, and whose ``forward(x, graph)`` maps this rank's
rows ``x`` [num_inner, F] to logits [num_inner, C], aggregating through ``graph``
(:class:`bnsgcn.nn.graph.EpochGraph`). The module is imported as ``python -m`` would from
the current directory, or from ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

from torch import nn

from bnsgcn.config import TrainConfig
from bnsgcn.config.sections import MODEL_ARGUMENTS
from bnsgcn.errors import UserError, first_sentence

DOCS = "docs/api.md, Your own model"


def load_model_class(path: str) -> type[nn.Module]:
    """The class ``path`` (``module.path:ClassName``, the class possibly nested:
    ``Outer.Inner``) names; :class:`UserError` in one line when its module cannot be
    imported, has no such name, or the name is not a subclass of ``torch.nn.Module``."""
    module_name, _, qualname = path.partition(":")
    module = _import(module_name, path)
    target = module
    for part in qualname.split("."):
        if not hasattr(target, part):
            raise UserError(
                f"--model {path}: {module_name} ({module.__file__}) has no {qualname}; name a class the module defines"
            )
        target = getattr(target, part)
    if not (isinstance(target, type) and issubclass(target, nn.Module)):
        kind = "class" if isinstance(target, type) else type(target).__name__
        raise UserError(
            f"--model {path} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a subclass of torch.nn.Module; name "
            "your model's class"
        )
    return target


def _import(module_name: str, path: str):
    """Import ``module_name`` with the current directory on the path, as ``python -m`` has it
    (a console script such as ``bnsgcn-train`` has its own directory there instead)."""
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise UserError(
                f"--model {path}: no module {exc.name} in the current directory ({here}) or on PYTHONPATH; run from "
                "the directory that holds it, or add that directory to PYTHONPATH"
            ) from None
        raise UserError(f"--model {path}: importing {module_name} failed: {first_sentence(exc)}") from exc
    except Exception as exc:
        raise UserError(
            f"--model {path}: importing {module_name} raised {type(exc).__name__}: {first_sentence(exc)}"
        ) from exc
    finally:
        if added:
            sys.path.remove(here)


def check_model_class(cls: type[nn.Module], path: str, options: dict) -> None:
    """:class:`UserError` in one line when ``cls``'s constructor does not take the keyword
    arguments bnsgcn builds it with, or its ``forward`` does not take ``(x, graph)``."""
    try:
        inspect.signature(cls).bind(**dict.fromkeys(MODEL_ARGUMENTS), **options)
    except TypeError as exc:
        names = ", ".join(MODEL_ARGUMENTS)
        raise UserError(
            f"--model {path}: its constructor cannot take the keyword arguments bnsgcn passes ({names}"
            f"{', and --model-options' if options else ''}): {exc}; define __init__(self, {names}, ...) ({DOCS})"
        ) from None
    try:
        inspect.signature(cls.forward).bind(None, None, None)  # self, x, graph
    except TypeError as exc:
        raise UserError(
            f"--model {path}: its forward{inspect.signature(cls.forward)} cannot take (x, graph): {exc}; define "
            f"forward(self, x, graph) ({DOCS})"
        ) from None


def checked_model_class(config: TrainConfig) -> type[nn.Module]:
    """The class ``config``'s ``--model`` names, checked (:func:`load_model_class`,
    :func:`check_model_class`): what the launcher asks before any rank starts."""
    cls = load_model_class(config.model.name)
    check_model_class(cls, config.model.name, config.model.keyword_options)
    return cls


def build_user_model(config: TrainConfig, in_channels: int, out_channels: int) -> nn.Module:
    """An instance of ``config``'s class: built with the job's widths, ``--layers``,
    ``--hidden``, ``--dropout`` and ``--model-options``."""
    cls = checked_model_class(config)
    m = config.model
    widths = dict(in_channels=in_channels, hidden_channels=m.hidden, out_channels=out_channels)
    return cls(**widths, num_layers=m.layers, dropout=m.dropout, **m.keyword_options)


def import_root(cls: type) -> Path | None:
    """The directory ``cls``'s module is imported from (the one holding its top-level
    package), for processes started elsewhere; None for a module without a file."""
    module = sys.modules[cls.__module__]
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    file = Path(file).resolve()
    depth = module.__name__.count(".") + (file.name == "__init__.py")
    return file.parents[depth]
