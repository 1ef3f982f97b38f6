"""Hook groups: named sets of hook functions chosen per forward.

Every registered hook function is in the group ``"all"``. A forward runs the hooks of
the chosen groups (or, with ``complement=True``, all the others).
"""

from __future__ import annotations

from collections.abc import Iterable

from torchsurgery._names import glob_match, is_glob
from torchsurgery.flex.hook_function import HookFunction

ALL = "all"


def name_matches(pattern: str, name: str) -> bool:
    """flex_model's rule (substring) for plain strings; our glob rules for globs."""
    return glob_match(pattern, name) if is_glob(pattern) else pattern in name


class HookGroups:
    """Which groups each hook function belongs to.

    Example:
        >>> groups = HookGroups()
        >>> hook = HookFunction("layers.0.mlp")
        >>> groups.add([hook], "mlps")
        >>> sorted(groups.groups_of(hook)), groups.members("mlps") == [hook]
        (['all', 'mlps'], True)
    """

    def __init__(self) -> None:
        self._groups: dict[HookFunction, set[str]] = {}
        # groups created with no member here (a pipeline stage that holds none of its modules)
        self._declared: set[str] = {ALL}

    def register(self, hook: HookFunction) -> None:
        self._groups.setdefault(hook, set()).add(ALL)

    def select(self, constructor: HookFunction | Iterable[HookFunction] | str, what: str) -> list[HookFunction]:
        """The registered hook functions a group constructor designates."""
        if isinstance(constructor, HookFunction):
            chosen = [constructor]
        elif isinstance(constructor, str):
            chosen = [h for h in self._groups if name_matches(constructor, h.module_name)]
        elif not isinstance(constructor, Iterable):
            raise TypeError(
                f"{what}: expected a module-name pattern, a HookFunction or several, got {constructor!r}"
            )
        else:
            chosen = list(constructor)
            bad = [h for h in chosen if not isinstance(h, HookFunction)]
            if bad:
                raise TypeError(f"{what}: expected HookFunctions, got {bad[:3]!r}")
        unknown = [h for h in chosen if h not in self._groups]
        if unknown:
            raise ValueError(f"{what}: {unknown[:3]!r} are not registered with this FlexModel; register them first")
        return chosen

    def add(self, hooks: Iterable[HookFunction], group: str, what: str = "torchsurgery.FlexModel") -> None:
        if not isinstance(group, str):
            raise TypeError(f"{what}: a group name is a string, got {group!r}")
        self._declared.add(group)
        for hook in hooks:
            self._groups.setdefault(hook, {ALL}).add(group)

    def discard(self, hooks: Iterable[HookFunction], group: str, what: str) -> None:
        if not isinstance(group, str):
            raise TypeError(f"{what}: a group name is a string, got {group!r}")
        if group == ALL:
            raise ValueError(f"{what}: every hook is in the group 'all'; it cannot be removed from it")
        for hook in hooks:
            self._groups[hook].discard(group)

    def groups_of(self, hook: HookFunction) -> set[str]:
        return set(self._groups.get(hook, ()))

    def members(self, group: str) -> list[HookFunction]:
        return [h for h, gs in self._groups.items() if group in gs]

    def known(self) -> set[str]:
        return self._declared.union(*self._groups.values())

    def active(self, groups: str | Iterable[str], complement: bool, what: str) -> set[HookFunction]:
        names = [groups] if isinstance(groups, str) else list(groups) if isinstance(groups, Iterable) else [groups]
        bad = [g for g in names if not isinstance(g, str)]
        if bad:
            raise TypeError(f"{what}: groups must be a group name or several, e.g. 'all' or ['early'], got {groups!r}")
        wanted = set(names)
        unknown = wanted - self.known()
        if unknown:
            raise ValueError(f"{what}: unknown hook group(s) {sorted(unknown)}; known: {sorted(self.known())}")
        chosen = {h for h, gs in self._groups.items() if gs & wanted}
        return set(self._groups) - chosen if complement else chosen
