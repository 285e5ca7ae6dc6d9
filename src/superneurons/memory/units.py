"""Which modules a plan decides for: the *units* of a model.

SuperNeurons plans per layer (Wang et al., PPoPP'18 §3); a transformer or residual network is
planned per block (:func:`default_units`), or per layer where a block's working set binds
(:func:`layer_units`; ``granularity="auto"`` splits only the largest blocks:
``memory.bounds.split_largest``).
"""

from __future__ import annotations

from torch import nn

__all__ = ["GRANULARITIES", "default_units", "layer_units"]

GRANULARITIES: tuple[str, ...] = ("block", "layer", "auto")


def default_units(model: nn.Module) -> list[str]:
    """The blocks of the model, plus every other part of the step's path to them.

    Blocks: the outermost non-leaf children of ``nn.Sequential``/``nn.ModuleList`` containers,
    descending through containers of blocks (stages): the zoo ResNets' residual blocks, GPT's
    transformer blocks. Then, so that a plan covers the whole step (the stem, the final norm, the
    head), every child of the root or of an ancestor of a block that neither is nor contains a
    block becomes a unit too (e.g. a ResNet's ``conv1``, ``bn1``, ``relu``, ``maxpool``, ``fc``;
    GPT's ``transformer.wte``, ``transformer.ln_f``, ``lm_head``). A model with no blocks (e.g.
    a flat ``nn.Sequential`` of layers) gets its leaf layers as units. Units come in
    ``named_modules`` order.
    """
    containers = (nn.Sequential, nn.ModuleList)
    found: list[str] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, containers):
            continue
        for name, child in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            grandchildren = list(child.children())
            if not grandchildren:
                continue  # a leaf layer: units are blocks
            if isinstance(child, containers) and all(any(g.children()) for g in grandchildren):
                continue  # a stage of blocks: its blocks are the units
            if not any(child_fqn.startswith(f + ".") for f in found):
                found.append(child_fqn)
    if not found:
        if isinstance(model, nn.Sequential):
            return [name for name, _ in model.named_children()]
        return []
    ancestors = {""} | {f.rsplit(".", i)[0] for f in found for i in range(1, f.count(".") + 1)}
    blocks = set(found)
    for fqn, module in model.named_modules():
        if fqn not in ancestors:
            continue
        for name, _ in module.named_children():
            child_fqn = f"{fqn}.{name}" if fqn else name
            if child_fqn not in ancestors and child_fqn not in blocks:
                found.append(child_fqn)
    position = {fqn: i for i, (fqn, _) in enumerate(model.named_modules())}
    return sorted(found, key=position.__getitem__)


def layer_units(model: nn.Module) -> list[str]:
    """Every leaf module (layer) as a unit: SuperNeurons' own granularity (Wang et al.,
    PPoPP'18 §3: the peak falls toward one *layer's* working set). Many more units than
    :func:`default_units` (ResNet-50: 126 instead of 22), so planning takes longer."""
    return [fqn for fqn, m in model.named_modules() if fqn and not any(m.children())]
