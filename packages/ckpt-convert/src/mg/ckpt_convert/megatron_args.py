"""Megatron-LM's saved args, for mg-convert: core's reader with its errors as ConvertError.

The mapping itself (args → `TransformerConfig` / `MambaConfig`, and the state an mg
checkpoint records) is core's :mod:`mg.core.checkpoint.megatron_args`, shared with
``load_model``; here its :class:`MegatronArgsError` becomes mg-convert's
:class:`ConvertError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import megatron_args as _core
from mg.core.checkpoint.megatron_args import MegatronArgsError

_F = TypeVar("_F", bound=Callable[..., Any])


def _as_convert_error(function: _F) -> _F:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except MegatronArgsError as error:
            raise ConvertError(str(error)) from None

    return wrapper  # type: ignore[return-value]


config_from_megatron_args = _as_convert_error(_core.config_from_megatron_args)
megatron_args_of = _as_convert_error(_core.megatron_args_of)
config_of_megatron = _as_convert_error(_core.config_of_megatron)
mg_state_of_megatron = _as_convert_error(_core.mg_state_of_megatron)
megatron_source_state = _as_convert_error(_core.megatron_source_state)
