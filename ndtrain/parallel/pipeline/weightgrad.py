"""Splitting a chunk's backward into B (input gradient) and W (weight gradients), for the
zero-bubble schedule.

After a forward, the autograd graph runs from the chunk's output back to its input and to
its parameters. B asks autograd for the input gradient only; the engine then evaluates only
the nodes on paths to the input, and a node such as the matmul of `x @ Wᵀ` computes its
gradient for x but not for W. At the *split nodes* (nodes on the input path with an edge into
a parameter-only subgraph) a pre-hook keeps the gradient arriving there. W later resumes
autograd from each split node with that gradient, restricted to the parameters behind it:
the same matmuls a full backward would have done, nothing recomputed, and gradients land in
`.grad` through AccumulateGrad, so data-parallel hooks fire as usual.

The graph (and every activation it saved) stays alive between B and W, which is what the
schedule counts as a micro-batch held. On the first chunk, whose input is token ids, no one
waits for an input gradient: B does nothing and W the whole backward. A chunk that uses one
weight twice cannot be split this way (resuming from one use would walk back through the
other): its B is the whole backward and W does nothing.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _reaches(root, target) -> dict:
    """For every node under `root`: whether a path leads from it to `target` (iterative DFS)."""
    reach: dict = {}
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reach:
            continue
        if expanded:
            reach[node] = node is target or any(n is not None and reach[n] for n, _ in node.next_functions)
            continue
        stack.append((node, True))
        stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in reach)
    return reach


def _params_under(node) -> list[torch.Tensor]:
    found, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        variable = getattr(n, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if variable is not None and variable.requires_grad:
            found.append(variable)
        stack.extend(child for child, _ in n.next_functions)
    return found


class SplitBackward:
    """B now (`input_grad`), W later (`weights()`), for one micro-batch of one chunk."""

    def __init__(self, output: torch.Tensor, inp: torch.Tensor | None, grad: torch.Tensor | None):
        """`inp`: the chunk's input activation (a leaf); None or token ids: no split, W does
        the whole backward."""
        self.output, self.grad = output, grad
        self.input_grad = None
        self.splits: list[tuple[object, list[torch.Tensor]]] = []
        self.captured: dict = {}
        if inp is None or not inp.requires_grad:
            return
        target = get_gradient_edge(inp).node  # AccumulateGrad of a leaf, or the embedding's node
        reach = _reaches(output.grad_fn, target)
        for node, on_path in reach.items():
            if not on_path:
                continue
            params = [p for child, _ in node.next_functions if child is not None and not reach[child]
                      for p in _params_under(child)]
            if params:
                self.splits.append((node, params))
        owners = [id(p) for _, params in self.splits for p in params]
        if len(owners) != len(set(owners)):
            # A weight used twice in the chunk: resuming from one use would also walk back
            # through the other. Keep it correct and simple: B does the whole backward.
            self.splits = []
            if inp.is_leaf:
                inp.grad = None
            torch.autograd.backward(output, grad)
            self.input_grad, self.output = (inp.grad if inp.is_leaf else None), None
            return
        hooks = [node.register_prehook(self._capture(node)) for node, _ in self.splits]
        try:
            (self.input_grad,) = torch.autograd.grad(output, inp, grad, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        if any(node is target for node, _ in self.splits):
            # autograd stopped at `inp` without running its node: W resumes there with B's result
            self.captured[target] = (self.input_grad,)

    def _capture(self, node):
        def hook(grad_outputs):
            self.captured[node] = grad_outputs
        return hook

    def weights(self) -> None:
        """Accumulate the weight gradients into `.grad`, then let the graph go."""
        if self.output is not None and not self.splits:
            torch.autograd.backward(self.output, self.grad)
        for node, params in self.splits:
            grads = self.captured.pop(node, None)
            if grads is None:  # no gradient reached this node (an unused branch)
                continue
            edges = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params,
                                    retain_graph=True)
        self.output = self.grad = None
        self.splits, self.captured = [], {}
