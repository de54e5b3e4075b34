"""``Module``: the base of pagedgen's layers and model modules, an ``nn.Module`` with cheap calls
and attribute reads.

One step of a small model calls dozens of modules and reads over a hundred parameters and
submodules (stories260K: ~65 calls, ~110 reads), where the whole forward pass of a decode step takes
a few hundred microseconds. ``nn.Module`` makes each call go through its hook dispatch and each read
of a registered parameter, buffer or submodule through a Python ``__getattr__`` (it keeps them in
``_parameters``/``_buffers``/``_modules``, not in the instance dict): together a double-digit share
of such a step. So here:

- calling a module runs its ``forward`` directly (pagedgen registers no hooks);
- every registered parameter, buffer and submodule is mirrored in the instance ``__dict__``, so
  that ``self.weight`` is a plain attribute read. The mirror is kept in step wherever
  ``nn.Module`` changes the registries: ``setattr``/``delattr``, ``register_*``/``add_module``
  and ``_apply`` (``to``, ``float``, ``cuda``...).

Everything else (``named_parameters``, ``state_dict``, ``modules``...) is ``nn.Module``'s own.
"""
from __future__ import annotations

from torch import nn


class Module(nn.Module):
    """An ``nn.Module`` whose call is its ``forward`` and whose registered members are plain
    attributes (see the module docstring)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # special methods are looked up on the type: m(x) runs forward

    def _mirror(self) -> None:
        """Copy the registered parameters, buffers and submodules into the instance dict."""
        d = self.__dict__
        for registry in (self._parameters, self._buffers, self._modules):
            d.update(registry)

    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)
        d = self.__dict__
        for registry in (d.get("_parameters"), d.get("_buffers"), d.get("_modules")):  # None before __init__
            if registry is not None and name in registry:
                d[name] = registry[name]

    def __delattr__(self, name) -> None:
        super().__delattr__(name)  # the registered member, or (mirrored) an instance attribute
        self.__dict__.pop(name, None)

    def register_parameter(self, name, param) -> None:
        self.__dict__.pop(name, None)  # nn.Module refuses names already in the instance dict
        super().register_parameter(name, param)
        self._mirror()

    def register_buffer(self, name, tensor, persistent: bool = True) -> None:
        self.__dict__.pop(name, None)
        super().register_buffer(name, tensor, persistent)
        self._mirror()

    def add_module(self, name, module) -> None:
        self.__dict__.pop(name, None)
        super().add_module(name, module)
        self._mirror()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)  # children run their own _apply, and mirror themselves
        self._mirror()
        return out
