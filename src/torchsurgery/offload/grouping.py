"""Choosing the groups of modules whose weights move together.

``"blocks"`` finds the repeated blocks of a model: the children of the longest
``nn.ModuleList``/``nn.Sequential`` whose children are all of one type (transformer
layers, UNet blocks). Everything outside the blocks that holds weights is grouped by the
top-level child it sits in. ``"leaves"`` makes every module that holds weights directly
a group. A list of qualified names gives full control.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchsurgery._names import no_match_message


def _holds_weights(module: nn.Module, recurse: bool) -> bool:
    return any(True for _ in module.parameters(recurse=recurse))


def repeated_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The qualified name of the longest same-typed ``ModuleList``/``Sequential`` and its children.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(4, 2), nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)]))
        >>> repeated_blocks(model)
        ('1', ['1.0', '1.1', '1.2'])
    """
    best: tuple[str, list[str]] = ("", [])
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        if not all(_holds_weights(c, True) for _, c in children):
            continue
        if len(children) > len(best[1]):
            prefix = f"{name}." if name else ""
            best = (name, [f"{prefix}{child}" for child, _ in children])
    return best


def _outside_groups(model: nn.Module, inside: set[str], container: str) -> list[str]:
    """Top-level pieces that hold weights but are not inside the blocks."""
    groups: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if name in inside:
                continue
            if name == container or any(b.startswith(f"{name}.") for b in inside):
                # the path down to the blocks: keep its own weights apart, descend
                if _holds_weights(child, False):
                    groups.append(name)
                visit(child, f"{name}.")
            elif _holds_weights(child, True):
                groups.append(name)

    visit(model, "")
    return groups


def find_groups(model: nn.Module, groups: str | Sequence[str], what: str = "torchsurgery.offload") -> list[str]:
    """Resolve ``groups`` (``"blocks"``, ``"leaves"`` or names) to qualified module names.

    Returns:
        Names of modules whose subtrees form the groups, without overlaps, in model order.
        The root's own parameters, if any, form the group ``""``.

    Raises:
        ValueError: unknown mode, unknown or overlapping names.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> find_groups(model, "leaves")
        ['0', '2']
    """
    named = dict(model.named_modules())
    if not isinstance(groups, (str, list, tuple)):
        raise TypeError(f"{what}: groups must be 'blocks', 'leaves' or a list of module names, got {groups!r}")
    if isinstance(groups, str):
        if groups == "leaves":
            found = [n for n, m in named.items() if _holds_weights(m, False)]
        elif groups == "blocks":
            container, blocks = repeated_blocks(model)
            if not blocks:
                found = [n for n, m in model.named_children() if _holds_weights(m, True)]
            else:
                found = blocks + _outside_groups(model, set(blocks), container)
            if _holds_weights(model, False):
                found.append("")
        else:
            raise ValueError(f"{what}: groups must be 'blocks', 'leaves' or a list of module names, got {groups!r}")
    else:
        found = list(groups)
        for name in found:
            if not isinstance(name, str) or name not in named:
                raise ValueError(no_match_message(f"{what} (groups)", str(name), [n for n in named if n]))
        for a in found:
            for b in found:
                if a != b and (a == "" or b.startswith(f"{a}.")):
                    raise ValueError(f"{what}: groups {a!r} and {b!r} overlap; give disjoint subtrees")
    order = {n: i for i, n in enumerate(named)}
    return sorted(dict.fromkeys(found), key=lambda n: order[n])
