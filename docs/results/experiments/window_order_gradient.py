"""Can a first-order (gradient) estimate order the window candidates as well as the end-to-end one?

choose_windows' default ranking runs every candidate from its own layer to the output (about n_layer / 2
forward passes). The local ranking (one pass, each layer's own output error) is blind to a window that helps
downstream and cost Qwen2.5-Coder-0.5B 1.8 points (docs/results/window.md). Tried here: one forward pass that
keeps every layer's input, then one backward pass layer by layer (each layer run again with autograd), which
gives the gradient g_k of the second-half loss with respect to each layer's attention output a_k; the
window's attention output a_k^w on the same input costs one more attention. The estimate of a candidate's
end-to-end loss change is <g_k, a_k^w - a_k>: it sees what the change does downstream, and its sign.

Compared with the end-to-end increases (the same texts, the same machine): Spearman rank correlation
and the times; and, for the three layers the estimate gets most wrong, the loss along the path
a + eps (a^w - a) (the HF model in memory), which shows why.

    python docs/results/experiments/window_order_gradient.py MODEL-DIR > out.json
"""
import json
import sys
import time

import torch

from nbl_gguf import models
from nbl_gguf.calibration import windows as w
from nbl_gguf.calibration.apply import ATTN_WINDOW, replace_layer
from nbl_gguf.calibration.dataset import KINDS, bundled_selection_windows
from nbl_gguf.calibration.stream import LOSS_POSITIONS, LayerStream
from nbl_gguf.calibration.variants import layer_output, run_variants
from nbl_gguf.model_source import resolve_model
from window_order_proxy import spearman  # the sibling experiment's (run from this folder's path)


def attention_output(stream, k, hidden, layer_type, layer_map, grad):
    """(layer k's output, its attention module's output) for ``hidden`` [1, ctx, d]."""
    adapter = models.get_adapter(stream.model)
    restore = replace_layer(stream.model, k, layer_type, {k: layer_map(k, layer_type)}) \
        if layer_type is not None else None
    seen = []
    module = getattr(stream.layers[k], adapter.attn)
    handle = module.register_forward_hook(lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        out = stream.run_layer(k, hidden, grad=grad)
    finally:
        handle.remove()
        if restore is not None:
            restore()
    return out, seen[0]


def loss_gradient(stream, final, ids, rows):
    """d(mean NLL over ``rows``)/d(final hidden) for one window, and the summed NLL."""
    hidden = final.detach().clone().requires_grad_(True)
    with torch.enable_grad(), stream._recorders({}, {}, hidden):
        out = stream.base(inputs_embeds=torch.zeros_like(hidden), use_cache=False)
    normed = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    leaf = normed.detach().requires_grad_(True)
    head = stream.model.get_output_embeddings()
    positions = rows.nonzero().flatten()
    total = 0.0
    for start in range(0, len(positions), LOSS_POSITIONS):
        at = positions[start:start + LOSS_POSITIONS]
        with torch.enable_grad():
            logits = head(leaf[0, at]).float()
            if stream.softcap is not None:
                logits = torch.tanh(logits / stream.softcap) * stream.softcap
            nll = torch.nn.functional.cross_entropy(logits, ids[0, at + 1], reduction="sum")
            nll.backward()
        total += float(nll.detach())
    with torch.enable_grad():
        normed.backward(leaf.grad)
    return hidden.grad, total


def gradient_estimates(stream, ids, pool, replaced, layer_map):
    """{layer: <dL/da_k, a_k^w - a_k>} summed over windows, L the mean NLL over the second halves."""
    n_layer = stream.num_layers
    rows = torch.zeros(ids.shape[1] - 1, dtype=torch.bool)
    rows[ids.shape[1] // 2:] = True
    scored = ids.shape[0] * int(rows.sum())
    inputs = [stream.embed_all(ids)]
    for k in range(n_layer):
        stream.load_layer(k)
        try:
            inputs.append(layer_output(stream, k, inputs[-1], replaced.get(k), layer_map))
        finally:
            stream.release_layer(k)
    stream.load_head()
    try:
        grads = [loss_gradient(stream, inputs[n_layer][i:i + 1], ids[i:i + 1], rows)[0] / scored
                 for i in range(ids.shape[0])]
    finally:
        stream.release_head()
    estimates = {}
    for k in reversed(range(n_layer)):
        stream.load_layer(k)
        try:
            total = 0.0
            for i in range(ids.shape[0]):
                h = inputs[k][i:i + 1].detach().clone().requires_grad_(True)
                with torch.enable_grad():
                    out, attn = attention_output(stream, k, h, replaced.get(k), layer_map, grad=True)
                    g_h, g_a = torch.autograd.grad(out, [h, attn], grad_outputs=grads[i])
                if k in pool:
                    with torch.no_grad():
                        _, windowed = attention_output(stream, k, inputs[k][i:i + 1], ATTN_WINDOW, layer_map,
                                                       grad=False)
                    total += float((g_a.double() * (windowed.double() - attn.detach().double())).sum())
                grads[i] = g_h.detach()
            if k in pool:
                estimates[k] = total
        finally:
            stream.release_layer(k)
        inputs[k + 1] = None
    return estimates


def path_losses(model_dir, ids, layer, window, steps=(0.01, -0.01, 0.5, 1.0)):
    """The second-half loss change with layer ``layer``'s attention output moved along the window's change,
    a + eps (a^w - a), for each eps of ``steps`` (the whole HF model in memory, float32, hooks): the
    derivative at 0 is what the gradient estimate gives; eps = 1 is the end-to-end change."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter, layers = models.get_adapter(model), models.decoder_layers(model)
    half = ids.shape[1] // 2

    def run(hook=None):
        nll, outputs = 0.0, []
        for i in range(ids.shape[0]):
            handle = getattr(layers[layer], adapter.attn).register_forward_hook(
                lambda _m, _a, out: hook(i, out, outputs)) if hook else None
            with torch.no_grad():
                logits = model(input_ids=ids[i:i + 1], use_cache=False).logits[0].float()
            if handle:
                handle.remove()
            nll += float(torch.nn.functional.cross_entropy(logits[half:-1], ids[i, half + 1:], reduction="sum"))
        return nll / (ids.shape[0] * (ids.shape[1] - 1 - half)), outputs

    def keep(_i, out, outputs):
        outputs.append((out[0] if isinstance(out, tuple) else out).detach())

    base, full = run(keep)
    restore = replace_layer(model, layer, ATTN_WINDOW, {layer: window})
    _, windowed = run(keep)
    restore()
    delta = [a - b for a, b in zip(windowed, full)]

    def moved(eps):
        def hook(i, out, _outputs):
            first = (out[0] if isinstance(out, tuple) else out) + eps * delta[i]
            return (first, *out[1:]) if isinstance(out, tuple) else first
        return hook

    return {eps: run(moved(eps))[0] - base for eps in steps}


def main():
    torch.set_num_threads(2)
    source = resolve_model(sys.argv[1])
    stream = LayerStream(source, models.resolve_dtype("auto", "cpu"), "cpu")
    ids, _ = bundled_selection_windows(stream.tokenizer, {k: 1 for k in KINDS}, w.DEFAULT_CTX)
    window = w.Window(w.DEFAULT_SIZE, w.DEFAULT_SINKS)
    layer_map = w.window_layer_map(window, None)
    layers = list(range(stream.num_layers))
    out = {"model": sys.argv[1], "ctx": int(ids.shape[1]), "dtype": str(stream.dtype)}

    started = time.perf_counter()
    estimates = gradient_estimates(stream, ids, layers, {}, layer_map)
    out["gradient_s"] = time.perf_counter() - started
    out["gradient"] = [estimates[i] for i in layers]
    print(f"gradient: {out['gradient_s']:.0f} s", file=sys.stderr, flush=True)

    started = time.perf_counter()
    variants = [{}] + [{i: ATTN_WINDOW} for i in layers]
    losses = w.second_half_loss(stream, run_variants(stream, ids, variants, layer_map), ids)
    out["end_to_end_s"] = time.perf_counter() - started
    increases = [loss - losses[0] for loss in losses[1:]]
    out["end_to_end"] = increases
    out["spearman"] = spearman(out["gradient"], increases)
    print(f"end to end: {out['end_to_end_s']:.0f} s, spearman {out['spearman']:.3f}", file=sys.stderr, flush=True)
    for i in layers:
        print(f"  layer {i:2d}: end to end {increases[i]:+.5f}  gradient {out['gradient'][i]:+.5f}", file=sys.stderr)

    if source.gguf is None:  # the path needs the HF folder in memory
        worst = sorted(layers, key=lambda i: out["gradient"][i] - increases[i])[:3]
        out["path"] = {str(i): {str(eps): v for eps, v in path_losses(source.hf_folder(), ids, i, window).items()}
                       for i in worst}
        print("path", json.dumps(out["path"]), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
