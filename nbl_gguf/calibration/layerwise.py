"""Running a model from any decoder layer on, over residual streams kept from an earlier pass.

Layer selection evaluates many variants of one model that differ only from some layer k on: the
input of layer k is then the same for all of them, so it is computed once per window and kept, and
each variant runs only layers k.. and the head. The model's own forward does the work, so masks,
rotary embeddings, sliding windows and logit soft-capping stay exactly the model's: the layers
before k are swapped for pass-throughs and layer k's input is replaced by the kept one.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from nbl_gguf.models import decoder_layers


class _PassThrough(nn.Module):
    def __init__(self, tuple_output: bool):
        super().__init__()
        self.tuple_output = tuple_output

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.tuple_output else hidden_states


def _hidden_states(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class LayerRunner:
    """Layer-range execution of ``model`` over fixed token windows ``input_ids`` [n, seqlen], in batches."""

    def __init__(self, model, input_ids: torch.Tensor, batch_size: int = 1):
        self.model = model
        self.input_ids = input_ids
        self.batch_size = max(1, batch_size)
        self.device = next(model.parameters()).device
        # transformers 4.x decoder layers return tuples, 5.x tensors
        self.tuple_output = int(__import__("transformers").__version__.split(".")[0]) < 5

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @contextmanager
    def _starting_at(self, first: int, hidden: torch.Tensor | None, batch: dict):
        """Layers < first pass through; layer ``first`` reads its input from ``hidden`` (rows of the batch)."""
        layers = decoder_layers(self.model)
        saved = [layers[i] for i in range(first)]
        for i in range(first):
            layers[i] = _PassThrough(self.tuple_output)
        handle = None
        if first > 0:
            def inject(module, args, kwargs):
                rows = hidden[batch["start"]:batch["start"] + batch["size"]].to(self.device)
                if args:
                    return (rows,) + tuple(args[1:]), kwargs
                return args, {**kwargs, "hidden_states": rows}

            handle = layers[first].register_forward_pre_hook(inject, with_kwargs=True)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            for i, layer in enumerate(saved):
                layers[i] = layer

    def _batches(self):
        for start in range(0, self.input_ids.shape[0], self.batch_size):
            ids = self.input_ids[start:start + self.batch_size].to(self.device)
            yield {"start": start, "size": ids.shape[0]}, ids

    @torch.no_grad()
    def run(self, first: int = 0, hidden: torch.Tensor | None = None, keep_inputs: bool = False):
        """(mean next-token NLL over all positions of every window, {k: input of layer k for k >= first}
        or None), running the layers from ``first`` on ``hidden`` (the input of layer ``first``; not
        needed when first is 0). Kept inputs are on the CPU."""
        layers = decoder_layers(self.model)
        kept: dict[int, list[torch.Tensor]] = {k: [] for k in range(first, len(layers))} if keep_inputs else {}
        total, count = 0.0, 0
        for batch, ids in self._batches():
            with ExitStack() as stack:
                stack.enter_context(self._starting_at(first, hidden, batch))
                for k in kept:
                    def grab(module, args, kwargs, k=k):
                        kept[k].append(_hidden_states(args, kwargs).detach().cpu())
                    stack.callback(layers[k].register_forward_pre_hook(grab, with_kwargs=True).remove)
                logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            targets = ids[:, 1:]
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
            count += targets.numel()
        return total / count, ({k: torch.cat(rows) for k, rows in kept.items()} if keep_inputs else None)

    def layer_inputs(self, first: int = 0, hidden: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
        return self.run(first, hidden, keep_inputs=True)[1]

    def loss(self, first: int = 0, hidden: torch.Tensor | None = None) -> float:
        return self.run(first, hidden)[0]
