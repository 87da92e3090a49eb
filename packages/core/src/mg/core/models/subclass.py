"""Change what a built module's forward does by giving it a subclass, never by assigning
`module.forward`.

A construction step (recompute, tensor-parallel dropout streams, FP8 exclusions)
sometimes has to run a module's own forward inside something: a checkpoint, an
RNG fork, an autocast. Assigning `module.forward` makes the result depend on
who patched last, and a module swapped in later (Transformer Engine's attention)
silently loses it. Wrapping the module in another would add a path component
to every parameter name, which Megatron's checkpoint names do not have.

So, as `torch.nn.utils.parametrize` does, the instance's class becomes a
subclass of its class and a mixin whose `forward` calls `super().forward`.
Parameters, buffers, hooks, names and `isinstance` checks stay as they were;
mixins compose by the method resolution order (the one given last runs
outermost), and `isinstance(module, Mixin)` tells whether a step has run.
"""

from __future__ import annotations

from torch import nn

_SUBCLASSES: dict[tuple[type, type], type] = {}


def extend_class(module: nn.Module, mixin: type) -> nn.Module:
    """Give `module` the subclass (`mixin`, its class); returns the module.

    `mixin.forward` runs outermost and reaches the module's previous forward
    through `super().forward`. The subclass is made once per pair of classes."""
    base = type(module)
    if isinstance(module, mixin):
        raise ValueError(f"{base.__name__} already has {mixin.__name__}")
    key = (mixin, base)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(
            f"{mixin.__name__}{base.__name__}",
            (mixin, base),
            {"__module__": base.__module__},
        )
    module.__class__ = _SUBCLASSES[key]
    return module


def swap_class(module: nn.Module, subclass: type) -> nn.Module:
    """Make `module` an instance of `subclass`, a subclass of its class written out in
    full (e.g. a linear that adds its bias after a reduction); returns the module."""
    if not issubclass(subclass, type(module)):
        raise TypeError(f"{subclass.__name__} is not a subclass of {type(module).__name__}")
    module.__class__ = subclass
    return module
