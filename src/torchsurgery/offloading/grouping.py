"""Choosing the groups of modules whose weights move together.

``"blocks"`` finds the repeated blocks of a model: the children of the longest
``nn.ModuleList``/``nn.Sequential`` whose children are all of one type (transformer
layers, UNet blocks). Outside the blocks every module that holds weights directly is a
group (embeddings, norms, heads), so a model that calls a part of a piece rather than the
piece (``self.x_embedder.proj(x)``) still brings the weights it uses in. ``"leaves"`` makes every module that holds weights directly
a group. A list of qualified names gives full control.

A group's weights come in when its module's ``forward`` runs, so a group must be a
module that is called, and a module whose ``forward`` reads its children's weights without
calling them (``nn.MultiheadAttention`` reads ``out_proj.weight``) is one group with them. Containers (``nn.ModuleList``, ``nn.ModuleDict``, a module
without a ``forward`` of its own) never are: ``"blocks"`` and ``"leaves"`` split such a
module into its children, recursively, and leave its own weights to the nearest
ancestor that is called (whose forward uses them). An explicit name of such a module is
refused, naming the children to give instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torchsurgery._names import no_match
from torchsurgery.errors import ArgumentTypeError, ArgumentValueError
from torchsurgery.patching import original_class

# modules whose forward reads their children's weights without calling the children
_READS_CHILDREN: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _holds_weights(module: nn.Module, recurse: bool) -> bool:
    return any(True for _ in module.parameters(recurse=recurse))


def _never_called(module: nn.Module) -> bool:
    """Whether ``module`` has no ``forward`` of its own (a container: only its children run)."""
    return original_class(module).forward is nn.Module.forward


def _children_with_weights(module: nn.Module, name: str) -> list[str]:
    prefix = f"{name}." if name else ""
    return [f"{prefix}{child}" for child, m in module.named_children() if _holds_weights(m, True)]


def _split_uncalled(named: dict[str, nn.Module], found: list[str]) -> list[str]:
    """Replace each group that is never called by its children, recursively.

    The replaced module's own weights are used by the module holding it, so the nearest
    called ancestor becomes a group (the root, ``""``, at the latest).
    """
    result: list[str] = []
    pending = list(found)
    while pending:
        name = pending.pop(0)
        module = named[name]
        if name == "" or not _never_called(module):
            result.append(name)
            continue
        pending.extend(_children_with_weights(module, name))
        if _holds_weights(module, False):
            parts = name.split(".")
            ancestors = (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1))
            result.append(next(a for a in ancestors if a == "" or not _never_called(named[a])))
    return result


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
    """The modules outside the blocks that hold weights directly."""
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
            else:
                # every module holding weights, not the piece itself: a model may bypass a
                # piece's forward and call its parts (``self.x_embedder.proj(x)``)
                groups.extend(n for n, m in child.named_modules(prefix=name) if _holds_weights(m, False))

    visit(model, "")
    return groups


def find_groups(model: nn.Module, groups: str | Sequence[str], what: str = "torchsurgery.offload") -> list[str]:
    """Resolve ``groups`` (``"blocks"``, ``"leaves"`` or names) to qualified module names.

    Returns:
        Names of modules whose subtrees form the groups, in model order. A module
        belongs to the innermost group containing it; the root's own parameters, if
        any, form the group ``""``.

    Raises:
        ValueError: unknown mode, unknown or overlapping names, or a name of a module
            that is never called (its children are named as the fix).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> find_groups(model, "leaves")
        ['0', '2']
    """
    named = dict(model.named_modules())
    if not isinstance(groups, (str, list, tuple)):
        raise ArgumentTypeError(what, "groups", groups, f"must be 'blocks', 'leaves' or a list of module names, got {groups!r}")
    found = _by_mode(model, named, groups, what) if isinstance(groups, str) else _checked_names(named, groups, what)
    order = {n: i for i, n in enumerate(named)}
    return sorted(dict.fromkeys(found), key=lambda n: order[n])


def _by_mode(model: nn.Module, named: dict[str, nn.Module], groups: str, what: str) -> list[str]:
    """The groups ``"leaves"`` or ``"blocks"`` name, modules never called split into their children."""
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
        raise ArgumentValueError(
            what, "groups", groups, f"must be 'blocks', 'leaves' or a list of module names, got {groups!r}"
        )
    return _split_uncalled(named, _whole_readers(named, found))


def _whole_readers(named: dict[str, nn.Module], found: list[str]) -> list[str]:
    """``found`` without the groups inside a module that reads its children's weights
    (:data:`_READS_CHILDREN`): they belong to the reader's group (or the one holding it) then."""
    readers = [n for n, m in named.items() if isinstance(m, _READS_CHILDREN)]
    return [n for n in found if not any(n.startswith(f"{r}.") if r else n != "" for r in readers)]


def _checked_names(named: dict[str, nn.Module], groups: list[str] | tuple[str, ...], what: str) -> list[str]:
    """The groups the user named, refused where unknown, overlapping or never called."""
    found = list(groups)
    if not found:
        raise ArgumentValueError(
            what, "groups", groups,
            "is an empty list: it names no module to offload; give module names, or 'blocks' or 'leaves'",
        )
    for name in found:
        if not isinstance(name, str) or name not in named:
            raise no_match(what, str(name), [n for n in named if n], arg="groups")
    for a in found:
        for b in found:
            if a != b and (a == "" or b.startswith(f"{a}.")):
                raise ArgumentValueError(what, "groups", groups, f"{a!r} and {b!r} overlap", "give disjoint subtrees")
    for name in found:
        module = named[name]
        if name and _never_called(module) and _holds_weights(module, True):
            raise ArgumentValueError(
                what, "groups", groups,
                f"{name!r} is a {type(module).__name__}, whose forward is never called (its weights would never come in)",
                f"name its children instead: {_children_with_weights(module, name)}",
            )
    return found
