"""Members found by name, one module each in a package: the order kinds
(:mod:`setdiff_dist.diffusion.kinds`) and the evaluation tasks (:mod:`setdiff_dist.eval.tasks`).
A new member is one file with a class marked ``@register``; callers ask the member found by its
name, never compare names. Imports nothing heavy: ``--help`` lists the members without torch."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable


class Registry:
    """The members of ``package`` (its modules are imported the first time a member is
    asked for), each a class with a ``name``; ``instance``: keep one instance of each rather
    than the class; ``what``: how an error names a member ("order kind"); ``first``: the
    built-in members' names, in the order the docs list them."""

    def __init__(self, package: str, what: str, instance: bool = False, first: tuple = ()):
        self.package, self.what, self.instance, self.first = package, what, instance, first
        self.members: dict = {}
        self._discovered = False

    def register(self, cls: type) -> type:
        """Class decorator: make ``cls`` the member named ``cls.name``."""
        if not cls.name or cls.name in self.members:
            raise ValueError(f"{self.what} {cls.name!r}: "
                             + ("no name" if not cls.name else "registered twice"))
        self.members[cls.name] = cls() if self.instance else cls
        return cls

    def discover(self) -> None:
        if not self._discovered:
            self._discovered = True
            path = importlib.import_module(self.package).__path__
            for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
                importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> tuple[str, ...]:
        """Every member's name: the built-in ones first, in their order, then the rest
        sorted."""
        self.discover()
        return tuple(k for k in self.first if k in self.members) + \
            tuple(sorted(k for k in self.members if k not in self.first))

    def get(self, name: str, error: Callable[[str], Exception]):
        """The member named ``name``; else ``error(message)`` is raised."""
        self.discover()
        if name not in self.members:
            raise error(f"unknown {self.what} {name!r}; expected one of "
                        f"{', '.join(self.names())}")
        return self.members[name]
