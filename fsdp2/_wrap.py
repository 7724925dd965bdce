"""``fully_shard_auto``: pick the modules to shard by class or predicate, then shard bottom-up.

The wrapping policy of FSDP1 (``auto_wrap_policy``) and Accelerate
(``transformer_layer_cls_to_wrap``) as one call. Planning happens first and touches
nothing: which modules become groups, which parameter each group owns, and every check
``fully_shard`` would make on each group. Only a plan that passes is carried out.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import torch.nn as nn

from .runtime import _fully_shard as _fs
from .runtime._fully_shard import fully_shard
from .runtime._state import get_state

__all__ = ["fully_shard_auto"]

logger = logging.getLogger(__name__)

ClassSpec = Union[type, str]
Predicate = Callable[[str, nn.Module], bool]


def fully_shard_auto(
    module: nn.Module,
    *,
    classes: ClassSpec | Iterable[ClassSpec] | None = None,
    predicate: Predicate | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply :func:`fully_shard` to every matching submodule, innermost first, then to ``module``.

    A submodule is a candidate when it is an instance of one of ``classes`` (a class, or a
    class name as a string that its class or one of its base classes has, as Accelerate's
    ``transformer_layer_cls_to_wrap`` takes them) or when ``predicate(name, submodule)`` is
    true (``name`` is its dotted name in ``module``). Each candidate becomes one group of the
    parameters under it that no inner candidate owns; ``module`` (the root) takes the rest.

    A parameter reachable from two groups (a tied embedding and LM head, both matched) would
    be sharded twice, which ``fully_shard`` refuses. Instead it goes to the group of its
    holders' lowest common ancestor (the innermost candidate containing that ancestor, else
    the root), and the candidates that held it are not sharded on their own; an INFO log
    record from ``fsdp2._wrap`` names them and the parameter.

    Every argument and every check ``fully_shard`` makes on each planned group runs before the
    first call, so an error leaves ``module`` untouched.

    Args:
        module: the root module; it is sharded last.
        classes: a module class, a class name, or an iterable of them. Each must match the root
            or at least one submodule.
        predicate: ``(name, submodule) -> bool`` choosing candidates; combined with ``classes``
            by "or". The root is never a candidate (it is always sharded).
        **fully_shard_kwargs: keyword arguments of :func:`fully_shard` (``mesh``,
            ``mp_policy``, ``reshard_after_forward``, ...), passed unchanged to every call.

    Returns:
        ``module``, sharded.

    Raises:
        TypeError / ValueError: bad ``classes``, ``predicate`` or keyword arguments, a module
            already sharded, or a planned group ``fully_shard`` would refuse; nothing is sharded.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard_auto: module must be an nn.Module, got {type(module).__name__}")
    _check_kwargs(fully_shard_kwargs)
    specs = _check_classes(classes)
    if predicate is not None and not callable(predicate):
        raise TypeError(f"fully_shard_auto: predicate must be callable (name, module) -> bool, "
                        f"got {type(predicate).__name__}")
    if not specs and predicate is None:
        raise ValueError("fully_shard_auto: pass classes= (e.g. the decoder layer class) or predicate=; "
                         "to shard the root alone call fully_shard(module)")
    grouping = _grouping(module, specs, predicate, fully_shard_kwargs.get("ignored_params") or set())
    _dry_run(grouping, fully_shard_kwargs)
    for name, sub in grouping.skipped:
        logger.info("fully_shard_auto: %r (%s) is not sharded on its own: %s", name,
                    type(sub).__name__, grouping.reasons[id(sub)])
    for name in grouping.order:
        fully_shard(grouping.modules[name], **fully_shard_kwargs)
    fully_shard(module, **fully_shard_kwargs)
    return module


# ---- arguments ---------------------------------------------------------------------------
def _check_kwargs(kwargs: dict[str, Any]) -> None:
    accepted = [name for name, p in inspect.signature(fully_shard).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"fully_shard_auto: unexpected keyword argument(s) {unknown}; it passes on only "
                        f"fully_shard's keyword arguments {accepted}")


def _check_classes(classes: Any) -> list[ClassSpec]:
    if classes is None:
        return []
    items = [classes] if isinstance(classes, (type, str)) else classes
    try:
        items = list(items)
    except TypeError:
        raise TypeError("fully_shard_auto: classes must be a module class, a class name, or an iterable of "
                        f"them, got {type(classes).__name__}") from None
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        if isinstance(item, str) and item:
            continue
        raise TypeError(f"fully_shard_auto: classes holds {item!r}; give nn.Module subclasses or their "
                        "names as strings (e.g. 'LlamaDecoderLayer')")
    return items


def _class_matches(module: nn.Module, spec: ClassSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return any(spec in (c.__name__, f"{c.__module__}.{c.__qualname__}") for c in type(module).__mro__)


# ---- grouping ----------------------------------------------------------------------------
@dataclass
class _Grouping:
    """Which submodules become groups, in the order to shard them (inner before outer)."""

    root: nn.Module
    modules: dict[str, nn.Module]  # candidate name -> module, for all candidates still planned
    order: list[str] = field(default_factory=list)
    skipped: list[tuple[str, nn.Module]] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    groups: dict[str, list[_fs.Found]] = field(default_factory=dict)  # "" is the root


def _post_order(module: nn.Module, prefix: str = "", seen: set[int] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """Every submodule once (first name wins, like ``named_modules``), children before parents."""
    seen = set() if seen is None else seen
    for name, child in module._modules.items():
        if child is None or id(child) in seen:
            continue
        seen.add(id(child))
        full = f"{prefix}{name}"
        yield from _post_order(child, f"{full}.", seen)
        yield full, child


def _candidates(root: nn.Module, specs: list[ClassSpec], predicate: Predicate | None) -> dict[str, nn.Module]:
    found: dict[str, nn.Module] = {}
    # The root counts as a match (naming the model's own class is no mistake) but is never a
    # candidate: it is sharded last in any case.
    hits = {i: int(_class_matches(root, spec)) for i, spec in enumerate(specs)}
    for name, sub in _post_order(root):
        matched = False
        for i, spec in enumerate(specs):
            if _class_matches(sub, spec):
                hits[i] += 1
                matched = True
        if predicate is not None:
            answer = predicate(name, sub)
            if not isinstance(answer, bool):
                raise TypeError(f"fully_shard_auto: predicate({name!r}, {type(sub).__name__}) returned "
                                f"{answer!r}; it must return True or False")
            matched = matched or answer
        if matched:
            found[name] = sub
    missing = [specs[i] for i, n in hits.items() if n == 0]
    if missing:
        names = [s if isinstance(s, str) else s.__name__ for s in missing]
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(f"fully_shard_auto: no submodule matches classes {names}; the model's classes are "
                         f"{present}")
    return found


def _grouping(root: nn.Module, specs: list[ClassSpec], predicate: Predicate | None, ignored: set) -> _Grouping:
    for name, sub in [("", root), *_post_order(root)]:
        if get_state(sub) is not None:
            raise ValueError(f"fully_shard_auto: {name or 'the root'} ({type(sub).__name__}) is already sharded; "
                             "call fully_shard_auto on a model with no fully_shard applied, or shard it by hand")
    grouping = _Grouping(root, _candidates(root, specs, predicate))
    while True:
        grouping.groups = _own_params(grouping, ignored)
        holders = _shared(grouping.groups)
        if not holders:
            break
        for holders_of_p in holders:
            names = [g for g, _ in holders_of_p]
            owner = _owner(grouping, names)
            for name, p_fqn in holders_of_p:
                if name != owner and name in grouping.modules:
                    sub = grouping.modules.pop(name)
                    grouping.skipped.append((name, sub))
                    others = ", ".join(f"{repr(g) if g else 'the root'} (as {f!r})"
                                       for g, f in holders_of_p if g != name)
                    grouping.reasons[id(sub)] = (f"it shares parameter {p_fqn!r} with {others}, so that parameter "
                                             f"goes to the group of {repr(owner) if owner else 'the root'}")
    grouping.order = [name for name, _ in _post_order(root) if name in grouping.modules]
    return grouping


def _own_params(grouping: _Grouping, ignored: set) -> dict[str, list[_fs.Found]]:
    """Each group's parameters: under its module, not under an inner candidate."""
    by_id = {id(m): n for n, m in grouping.modules.items()}
    groups: dict[str, list[_fs.Found]] = {}
    for gname, gmod in [("", grouping.root), *grouping.modules.items()]:
        found: dict[int, _fs.Found] = {}

        def visit(module: nn.Module, prefix: str) -> None:
            for pname, param in module._parameters.items():
                if param is None or param in ignored:
                    continue
                if id(param) in found:
                    found[id(param)][1].append((module, pname))
                else:
                    found[id(param)] = (param, [(module, pname)], prefix + pname)
            for cname, child in module._modules.items():
                if child is not None and id(child) not in by_id:
                    visit(child, f"{prefix}{cname}.")

        visit(gmod, f"{gname}." if gname else "")
        groups[gname] = list(found.values())
    return groups


def _shared(groups: dict[str, list[_fs.Found]]) -> list[list[tuple[str, str]]]:
    """Parameters two or more groups reach: for each, every (group name, fqn there)."""
    reach: dict[int, list[tuple[str, str]]] = {}
    for gname, found in groups.items():
        for param, _locations, p_fqn in found:
            reach.setdefault(id(param), []).append((gname, p_fqn))
    return [holders for holders in reach.values() if len(holders) > 1]


def _owner(grouping: _Grouping, names: list[str]) -> str:
    """The innermost remaining candidate containing the groups' lowest common ancestor, or the root."""
    paths = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    for depth in range(len(common), 0, -1):
        name = ".".join(common[:depth])
        if name in grouping.modules:
            return name
    return ""


def _dry_run(grouping: _Grouping, kwargs: dict[str, Any]) -> None:
    """The checks ``fully_shard`` makes, on every planned group, before anything is changed."""
    defaults = {n: p.default for n, p in inspect.signature(fully_shard).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    order = [*grouping.order, ""]  # the order of the calls, so the first error is the one they would raise
    for name in order:
        _fs.check_modules(grouping.modules[name] if name else grouping.root)
    args = _fs.check_arguments(**{**defaults, **kwargs})
    for found in (grouping.groups[name] for name in order):
        for param, _locations, p_fqn in found:
            owner = param.__dict__.get(_fs._SHARDED_BY_ATTR)
            if owner is not None:
                raise ValueError(f"fully_shard_auto: parameter {p_fqn!r} is already sharded by {owner}; pass it "
                                 "in ignored_params or shard the model that owns it together with this one")
        _fs.check_group(found, args)
