"""One matmul where a decoder layer runs several on the same input: the decode step's fused projections.

A decode step is a few rows deep, so each of its matmuls is a short kernel and a layer's time goes
to launching and draining them more than to reading its weights. Hugging Face's decoder layers
project the same normed hidden state three times for attention (``q_proj``, ``k_proj``, ``v_proj``)
and twice for the gated MLP (``gate_proj``, ``up_proj``): seven matmuls a layer where four would
do. Inductor does not merge them (AOTAutograd's graph keeps three ``addmm`` over three views of the
input), and stacking the weights in the model itself would change the trainer's parameters.

``FusedProjections(model)`` leaves the model alone. It stacks each group's weights (and biases)
into one new tensor and returns, as ``.model``, a shallow copy of the model (sharing every other
module, parameter and buffer) in which each member of a group is a ``_Part``: the first member
called in a forward computes the group's one product and the others take their columns of it.
Which member comes first does not matter, and a member called on another input computes its own
product (correct, only not fused). The stacked weights are buffers of the parts, so ``torch.compile``
treats their shapes as static; the parts' bookkeeping is plain Python that dynamo traces away (one
graph, no break: ``tests/test_fusing.py``).

The stacked weights are a copy: ``refresh()`` copies the model's current weights into them, in
place, so a captured graph that reads them sees a trainer's update without a recapture (the rollout
calls it at the start of every call that reuses its decode step). ``fused_nbytes(model)`` is the
copy's memory: 0.47 GB for Qwen2.5-0.5B, 3.6 GB for Qwen2.5-3B, so a refresh reads and writes ~1
and ~7 GB, a copy bound by the device's memory bandwidth (not timed).
``RolloutConfig(fuse_projections="auto")`` fuses the graph-captured step when the copy is at most
``FUSE_MEMORY_FRACTION`` of the device's memory.

    fused = FusedProjections(model)             # fused.groups: [] when the model has none to fuse
    logits = fused.model(input_ids=..., ...)    # as model(...), four matmuls a layer
    fused.refresh()                             # after the model's weights changed
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from rollout_lab.engine.runner.compiling import shallow_copy

# the groups of linears that one decoder layer applies to the same input, as HF names them
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# "auto" fuses when the stacked weights take at most this share of the device's memory
FUSE_MEMORY_FRACTION = 0.1


def fusable(model: torch.nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(owner module's dotted name, member names) of every group of ``FUSED_GROUPS`` the model holds
    as ``nn.Linear``s of one input width, dtype and device, all with a bias or all without."""
    found = []
    for name, module in model.named_modules():
        for names in FUSED_GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is torch.nn.Linear for lin in linears):
                continue
            first = linears[0]
            if any(lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
                   or lin.weight.device != first.weight.device or (lin.bias is None) != (first.bias is None)
                   for lin in linears):
                continue
            found.append((name, names))
    return found


def fused_nbytes(model: torch.nn.Module) -> int:
    """Bytes ``FusedProjections(model)`` would allocate: the weights (and biases) of every group."""
    total = 0
    for owner, names in fusable(model):
        module = model.get_submodule(owner)
        for n in names:
            lin = getattr(module, n)
            total += lin.weight.nbytes + (0 if lin.bias is None else lin.bias.nbytes)
    return total


class _Product:
    """One group's product in the forward under way: its input, the product, and the members yet to
    take their columns (0 between forwards)."""

    def __init__(self, num_members: int):
        self.num_members = num_members
        self.left = 0
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None


class _Part(torch.nn.Module):
    """A member of a fused group: columns ``[start, end)`` of the group's product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, product: _Product, start: int, end: int):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # the group's stacked weights, shared
        self.register_buffer("bias", bias, persistent=False)
        self.product, self.start, self.end = product, start, end
        self.in_features, self.out_features = weight.shape[1], end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.product
        if p.left == 0 or p.input is not x:  # the first member this forward (or another input): compute
            p.input, p.output, p.left = x, F.linear(x, self.weight, self.bias), p.num_members
        out = p.output[..., self.start: self.end]
        p.left -= 1
        if p.left == 0:  # the last member: drop the references until the next forward
            p.input = p.output = None
        return out


class FusedProjections:
    """A shallow copy of ``model`` whose grouped projections run as one matmul (module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.groups = fusable(model)
        self._members: list[tuple[list[torch.nn.Linear], torch.Tensor, torch.Tensor | None]] = []
        self.model = shallow_copy(model)
        owners: dict[str, torch.nn.Module] = {"": self.model}
        for owner, names in self.groups:
            twin = self._twin(owners, owner)
            linears = [getattr(model.get_submodule(owner), n) for n in names]
            with torch.no_grad():
                weight = torch.cat([lin.weight for lin in linears]).detach()
                bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears]).detach()
            product, start = _Product(len(names)), 0
            for n, lin in zip(names, linears):
                twin._modules[n] = _Part(weight, bias, product, start, start + lin.out_features)
                start += lin.out_features
            self._members.append((linears, weight, bias))

    def refresh(self) -> None:
        """Copy the model's current weights into the stacked ones (in place: captured graphs keep
        reading them). Reads the linears as the model holds them now, so a parameter replaced by
        ``load_state_dict(assign=True)`` is read too."""
        with torch.no_grad():
            for linears, weight, bias in self._members:
                start = 0
                for lin in linears:
                    end = start + lin.out_features
                    weight[start:end].copy_(lin.weight)
                    if bias is not None:
                        bias[start:end].copy_(lin.bias)
                    start = end

    def tensors(self) -> Iterator[torch.Tensor]:
        """The stacked weights and biases (what a captured graph reads besides the model's own)."""
        for _, weight, bias in self._members:
            yield weight
            if bias is not None:
                yield bias

    def _twin(self, owners: dict[str, torch.nn.Module], name: str) -> torch.nn.Module:
        """The copy's module at ``name``: a shallow copy of the original, made (with the path down to
        it) the first time a group needs it."""
        if name in owners:
            return owners[name]
        parent_name, _, last = name.rpartition(".")
        parent = self._twin(owners, parent_name)
        twin = shallow_copy(parent._modules[last])
        parent._modules[last] = twin
        owners[name] = twin
        return twin


