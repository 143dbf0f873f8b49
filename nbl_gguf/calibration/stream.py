"""Layer-streamed calibration: one decoder layer's weights in memory at a time.

The model is a module tree on the meta device (calibration.weights). The calibration windows' hidden
states go from layer to layer (calibration.hidden); for each layer k: its weights are read, the
windows run through it while hooks fold its attention input X and output Y into the statistics, its
map is solved and saved, and its weights are freed. The held-out windows ride along unchanged, and
their input of every layer is kept on disk, so that layer selection can start a variant of the model
at the first layer it replaces (StreamedEvaluator). Peak memory is one layer, one layer's statistics
and the hidden states, whatever the number of layers.

The decoder layers are called with the arguments the model's own forward gives them (masks, rotary
embeddings, sliding windows, per-layer types): they are recorded once per batch shape by running the
model's forward with every layer swapped for a recorder. The embedding is needed only for the rows of
the tokens in the text, the LM head only for the held-out losses.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from nbl_gguf import models
from nbl_gguf.calibration import weights as weight_io
from nbl_gguf.calibration.capture import capture_activations
from nbl_gguf.calibration.hidden import HiddenStates, tensor_bytes
from nbl_gguf.calibration.select import MIN_HELDOUT_TOKENS
from nbl_gguf.errors import NblError

LOSS_POSITIONS = 256  # positions per LM-head matmul: the logits of a whole window may not fit


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during a forward of the model: records the arguments the
    model gives the layer, and passes the hidden states on (or puts ``inject`` in their place)."""

    def __init__(self, index: int, calls: dict, inputs: dict, tuple_output: bool, inject=None):
        super().__init__()
        self.index, self.calls, self.inputs, self.tuple_output, self.inject = index, calls, inputs, tuple_output, inject

    def forward(self, hidden_states, *args, **kwargs):
        self.calls[self.index] = (args, kwargs)
        self.inputs[self.index] = hidden_states
        out = hidden_states if self.inject is None else self.inject
        return (out,) if self.tuple_output else out


def load_config_and_tokenizer(source):
    """(config, tokenizer) of a model_source.ModelSource without reading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    if source.gguf is not None:
        folder, name = str(source.gguf.path.parent), source.gguf.path.name
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = str(source.hf_folder()), {}
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
        models.get_adapter(config)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except NblError:
        raise
    except Exception as error:  # noqa: BLE001 - each loader has its own error types
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NblError(f"cannot load the model's config or tokenizer from {source.gguf.path if source.gguf else folder} "
                       f"({type(error).__name__}: {first})") from error
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config, tokenizer


class LayerStream:
    """A model run one decoder layer at a time from a WeightSource: a model_source.ModelSource's file
    or folder (``LayerStream(source, dtype, device)``), or a model in memory (``LayerStream.resident``)."""

    def __init__(self, source, dtype, device: str, name: str | None = None):
        config, tokenizer = load_config_and_tokenizer(source)
        path = str(source.gguf.path if source.gguf is not None else source.hf_folder())
        self._build(config, tokenizer, dtype, device, name or source.name, path,
                    lambda skeleton: weight_io.open_source(skeleton, source))

    @classmethod
    def resident(cls, model, tokenizer=None, name: str = "the loaded model") -> "LayerStream":
        """The stream over a model already in memory, in its dtype and on its device (its weights are
        served, not copied)."""
        import copy

        stream = cls.__new__(cls)
        weight = next(model.parameters())
        stream._build(copy.deepcopy(model.config), tokenizer, weight.dtype, str(weight.device), name,
                      getattr(model.config, "_name_or_path", ""),
                      lambda skeleton: weight_io.ResidentSource(skeleton, model))
        return stream

    def _build(self, config, tokenizer, dtype, device: str, name: str, path: str, open_weights) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.adapter = models.get_adapter(self.config)
        self.dtype, self.device = dtype, device
        self.name, self.path = name, path
        self.model = weight_io.skeleton(self.config, dtype)
        self.weights = open_weights(self.model)
        self.base = models.base_model(self.model)
        self.layers = models.decoder_layers(self.model)
        self.embed_name = weight_io.module_name(self.model, self.model.get_input_embeddings()) + ".weight"
        head = self.model.get_output_embeddings()
        self.head_name = weight_io.module_name(self.model, head) + ".weight"
        self.tuple_output = int(__import__("transformers").__version__.split(".")[0]) < 5
        text = models.text_config(self.config)
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.hidden_size = text.hidden_size
        # the decoder's small parameters (final norm, ...): everything under the decoder stack that is
        # neither a layer nor the embedding; a vision tower beside it is never read
        base_prefix = self.adapter.base + "."
        layer_prefix = self.adapter.layers + "."
        for param_name, _ in list(self.model.named_parameters()):
            if param_name.startswith(base_prefix) and not param_name.startswith(layer_prefix) \
                    and param_name != self.embed_name:
                self.weights.load_parameter(param_name, dtype, device)
        self._calls: dict[int, list] = {}  # batch size -> [(args, kwargs)] per layer
        self._embedding_rows: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_prefix(self, index: int) -> str:
        return f"{self.adapter.layers}.{index}"

    def layer_bytes(self) -> int:
        """Bytes of one decoder layer's parameters in the compute dtype (the largest layer)."""
        sizes = [sum(tensor_bytes(p.shape, self.dtype) for p in layer.parameters()) for layer in self.layers]
        return max(sizes)

    # --- running the model's own forward around the layers ------------------------------------------

    @contextmanager
    def _recorders(self, calls: dict, inputs: dict, inject=None):
        saved = list(self.layers)
        last = len(saved) - 1
        for i in range(len(saved)):
            self.layers[i] = _Recorder(i, calls, inputs, self.tuple_output, inject if i == last else None)
        try:
            yield
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer

    def _forward_base(self, inputs_embeds: torch.Tensor, inject=None):
        calls, inputs = {}, {}
        with torch.no_grad(), self._recorders(calls, inputs, inject):
            out = self.base(inputs_embeds=inputs_embeds, use_cache=False)
        return calls, inputs, out

    def calls(self, batch: int, seqlen: int) -> list:
        """The (args, kwargs) the model's forward passes to each layer for a batch of this shape."""
        key = (batch, seqlen)
        if key not in self._calls:
            zeros = torch.zeros(batch, seqlen, self.hidden_size, dtype=self.dtype, device=self.device)
            calls, _, _ = self._forward_base(zeros)
            self._calls[key] = [calls[i] for i in range(self.num_layers)]
        return self._calls[key]

    def prepare_embedding(self, *token_sets: torch.Tensor) -> None:
        """Read the embedding rows of every token in ``token_sets`` (and no others)."""
        rows = torch.unique(torch.cat([t.reshape(-1) for t in token_sets if t is not None]))
        table = self.weights.embedding_rows(self.embed_name, rows, self.dtype).to(self.device)
        weight_io.set_parameter(self.model, self.embed_name, table)
        self._embedding_rows = rows.to(self.device)

    def release_embedding(self) -> None:
        param = self.model.get_parameter(self.embed_name)
        weight_io.set_parameter(self.model, self.embed_name,
                                torch.empty((0, param.shape[1]), dtype=self.dtype, device="meta"))
        self._embedding_rows = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input of layer 0 for token windows ``ids`` [batch, seqlen] (embedding, and any scaling
        the model's forward applies before its first layer)."""
        ids = ids.to(self.device)
        local = torch.searchsorted(self._embedding_rows, ids)
        if not torch.equal(self._embedding_rows[local.clamp(max=len(self._embedding_rows) - 1)], ids):
            raise NblError("embed(): a token outside the prepared embedding rows")
        embedding = self.model.get_input_embeddings()
        # the module's padding index names a row of the whole vocabulary, which the prepared rows may not
        # hold; it only shapes gradients, so the lookup (and any scaling the module applies) is the same
        padding_idx, embedding.padding_idx = embedding.padding_idx, None
        try:
            with torch.no_grad():
                inputs_embeds = embedding(local)
        finally:
            embedding.padding_idx = padding_idx
        calls, inputs, _ = self._forward_base(inputs_embeds)
        self._calls.setdefault(tuple(ids.shape), [calls[i] for i in range(self.num_layers)])
        return inputs[0]

    # --- layers -----------------------------------------------------------------------------------------

    def load_layer(self, index: int) -> None:
        self.weights.load(self.layer_prefix(index), self.dtype, self.device)

    def release_layer(self, index: int) -> None:
        weight_io.release_parameters(self.model, self.layer_prefix(index))

    def run_layer(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.calls(hidden.shape[0], hidden.shape[1])[index]
        with torch.no_grad():
            return _first(self.layers[index](hidden.to(self.device), *args, **kwargs))

    # --- the LM head ------------------------------------------------------------------------------------

    def load_head(self) -> None:
        weight_io.set_parameter(self.model, self.head_name,
                                self.weights.matrix(self.head_name, self.dtype).to(self.device))

    def release_head(self) -> None:
        param = self.model.get_parameter(self.head_name)
        weight_io.set_parameter(self.model, self.head_name,
                                torch.empty(param.shape, dtype=self.dtype, device="meta"))

    def token_nll(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Next-token NLL [windows, seqlen - 1] (float64, CPU) of windows ``ids`` whose last layer's output
        is ``hidden``: the model's final norm, its head and logit soft-capping, as its forward computes them."""
        hidden = hidden.to(self.device)
        _, _, out = self._forward_base(torch.zeros_like(hidden), inject=hidden)
        normed = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = self.model.get_output_embeddings()
        ids = ids.to(self.device)
        seqlen = ids.shape[1]
        values = torch.empty(ids.shape[0], seqlen - 1, dtype=torch.float64)
        with torch.no_grad():
            for start in range(0, seqlen - 1, LOSS_POSITIONS):
                stop = min(seqlen - 1, start + LOSS_POSITIONS)
                # as rows of a 2-D matrix: a slice along the positions keeps the window's batch stride,
                # and with it torch's bf16 CPU matmul left its fast path (10x slower at the 8B shape)
                logits = head(normed[:, start:stop].reshape(-1, normed.shape[-1]))
                if self.softcap is not None:
                    logits = torch.tanh(logits / self.softcap) * self.softcap
                nll = torch.nn.functional.cross_entropy(logits.float(), ids[:, start + 1:stop + 1].reshape(-1),
                                                        reduction="none")
                values[:, start:stop] = nll.reshape(ids.shape[0], stop - start).double().cpu()
        return values


# --- the calibration pass -------------------------------------------------------------------------------

@dataclass
class StreamTimes:
    """Seconds spent in each part of the layer loop, summed over layers, and each layer's total."""

    parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    per_layer: list[float] = field(default_factory=list)

    @contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - start

    def as_report(self) -> dict:
        return {"parts_s": {k: round(v, 3) for k, v in self.parts.items()},
                "per_layer_s": [round(v, 3) for v in self.per_layer]}


@dataclass
class HiddenPlan:
    """Where the hidden states live: 'memory' (a device) or files only, from the memory budget."""

    memory: str | None
    reason: str
    fixed: int = 0  # bytes planned for one layer, its statistics, the solve and a batch's activations
    hidden: int = 0  # bytes of the hidden states (this layer's input and output, calibration and held-out)


def taps_bytes(d: int, taps: int) -> int:
    """Memory of one layer's taps statistics (float64 sums over the K d stacked inputs) and their solve
    ((K-1) d square float64 matrices: 6 to 7.4 of them at the peak, measured by
    scripts/bench_taps_layer.py at d 1024 and 2048 on a CPU and 4096 on an H200); 0 without taps."""
    if taps < 2:
        return 0
    stacked = taps * d
    return (stacked * stacked + d * stacked) * 8 + 7 * ((taps - 1) * d) ** 2 * 8


def plan_hidden(stream: LayerStream, windows: int, seqlen: int, heldout: int, batch_size: int, targets,
                budget_bytes: int | None, taps: int = 1) -> HiddenPlan:
    """Check that one layer fits and decide where the windows' hidden states go: on the compute
    device when they fit beside one layer (a GPU's free memory; on a CPU, ``budget_bytes``), else in
    host memory within ``budget_bytes``, else on disk."""
    d = stream.hidden_size
    layer = stream.layer_bytes()
    stats = (2 if "block" in targets else 1) * (3 * d * d * 8 + 3 * d * d * 4) + taps_bytes(d, taps)
    solve = 8 * d * d * 8  # eigendecompositions and whitening in float64
    inter = max((getattr(models.text_config(stream.config), "intermediate_size", 4 * d) or 4 * d), d)
    activations = batch_size * seqlen * (6 * d + 3 * inter) * 4
    fixed = layer + stats + solve + activations
    hidden = 2 * tensor_bytes((windows + heldout, seqlen, d), stream.dtype)
    gib = 2**30
    parts = (f"the layer's weights {layer / gib:.2f}, its statistics {stats / gib:.2f}, the solve {solve / gib:.2f}, "
             f"a batch's activations {activations / gib:.2f}")
    if stream.device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(stream.device))[0]
        if fixed > free:
            raise NblError(f"{stream.device} has {free / gib:.2f} GiB free, and one layer of {stream.name} needs about "
                           f"{fixed / gib:.2f} GiB ({parts}): use --stats-device cpu, a smaller --batch-size, or "
                           f"--device cpu")
        if fixed + hidden <= 0.9 * free:
            return HiddenPlan(stream.device, f"hidden states on {stream.device} ({hidden / gib:.2f} GiB)", fixed, hidden)
        fixed = 0  # the layer is on the GPU: host memory holds only the hidden states
    elif budget_bytes is not None and budget_bytes < fixed:
        raise NblError(f"--memory-budget {budget_bytes / gib:.2f} GiB cannot hold one layer of {stream.name}: it needs "
                       f"about {fixed / gib:.2f} GiB ({parts})")
    if budget_bytes is None or fixed + hidden <= budget_bytes:
        where = "memory" if budget_bytes is not None else "memory (no budget given)"
        return HiddenPlan("cpu", f"hidden states in {where} ({hidden / gib:.2f} GiB)", fixed, hidden)
    return HiddenPlan(None, f"hidden states on disk ({hidden / gib:.2f} GiB over the budget's "
                            f"{(budget_bytes - fixed) / gib:.2f} GiB left after one layer)", fixed, hidden)


def _batches(count: int, batch_size: int):
    for start in range(0, count, max(1, batch_size)):
        yield start, min(count, start + max(1, batch_size))


def calibrate_layers(stream: LayerStream, calib_ids: torch.Tensor, heldout_ids: torch.Tensor | None, state,
                     *, batch_size: int, targets, stats_device: str, save_covariances: bool, plan: HiddenPlan,
                     progress: bool = True, times: StreamTimes | None = None, taps: int = 1,
                     taps_rank: int | None = None) -> list[dict]:
    """Fit every layer, streaming; returns the per-layer entries (their tensors are in ``state``).

    ``state`` (calibration.resume.CalibrationState, opened) holds the finished layers and the hidden
    states; a state with layers done continues after them. ``taps`` > 1 also fits each layer's
    past-token map (calibration.layer_fit: from the same moments as its per-token map)."""
    from tqdm import tqdm

    from nbl_gguf.calibration.layer_fit import LayerFit

    times = times or StreamTimes()
    count, seqlen = calib_ids.shape
    held = 0 if heldout_ids is None else heldout_ids.shape[0]
    d = stream.hidden_size
    shape = (count, seqlen, d)
    num_layers = stream.num_layers
    done = state.layers_done

    def calib_store(layer: int, existing: bool) -> HiddenStates:
        return HiddenStates(shape, stream.dtype, plan.memory, state.path(f"calib-{layer}.bin"), existing)

    def held_store(layer: int, existing: bool) -> HiddenStates | None:
        if not held:
            return None
        return HiddenStates((held, seqlen, d), stream.dtype, None, state.path(f"heldout-{layer}.bin"), existing)

    if done < num_layers:
        with times.part("embedding"):
            if done == 0:
                stream.prepare_embedding(calib_ids, heldout_ids)
                current, current_held = calib_store(0, False), held_store(0, False)
                for start, stop in _batches(count, batch_size):
                    current.write(start, stream.embed(calib_ids[start:stop]))
                for start, stop in _batches(held, batch_size):
                    current_held.write(start, stream.embed(heldout_ids[start:stop]))
                stream.release_embedding()
                current.flush()
                if current_held is not None:
                    current_held.flush()
            else:
                current, current_held = calib_store(done, True), held_store(done, True)

    with_block = "block" in targets
    entries = [state.layer_entry(i) for i in range(done)]
    bar = tqdm(total=num_layers, initial=done, desc="calibration layers", unit="layer", disable=not progress,
               file=sys.stderr)
    for k in range(done, num_layers):
        layer_start = time.perf_counter()
        with times.part("load_weights"):
            stream.load_layer(k)
        layer_fit = LayerFit(k, d, stats_device, with_block, taps)

        def on_attention(i, h, x, y):
            with times.part("statistics"):
                layer_fit.on_attention(h, x, y)

        def on_block(i, h, out):
            with times.part("statistics"):
                layer_fit.on_block(h, out)

        following = calib_store(k + 1, False) if k + 1 < num_layers else None
        following_held = held_store(k + 1, False)
        with times.part("forward"), capture_activations(stream.model, stream.adapter, on_attention,
                                                        on_block, only=[k]):
            for start, stop in _batches(count, batch_size):
                out = stream.run_layer(k, current.read(start, stop))
                if following is not None:
                    following.write(start, out)
                layer_fit.check_finite()
        with times.part("heldout"):
            for start, stop in _batches(held, batch_size):
                following_held.write(start, stream.run_layer(k, current_held.read(start, stop)))
        with times.part("solve"):
            entry, tensors = layer_fit.solve(save_covariances, taps_rank)
        layer_fit = None  # its sums (K d x K d with taps: 2 GiB at d 4096) are not kept into the next layer
        with times.part("save"):
            state.save_layer(k, entry, tensors)
            for store in (following, following_held):
                if store is not None:
                    store.flush()
            state.finish_layer(k)
        stream.release_layer(k)
        if current.path is not None:
            current.path.unlink(missing_ok=True)
        current, current_held = following, following_held
        entries.append(entry)
        times.per_layer.append(time.perf_counter() - layer_start)
        bar.update()
    bar.close()
    return entries


# --- layer selection on the held-out windows -------------------------------------------------------

def run_variants(stream: LayerStream, ids: torch.Tensor, variants: list[dict[int, int]], linear, batch_size: int = 1,
                 base_input=None) -> list[torch.Tensor]:
    """The last layer's output for windows ``ids`` of each variant of the model ({layer: layer type}
    of its replaced layers; apply.py's codes), reading each layer once.

    A variant's hidden states are the unmodified model's until its first replaced layer; variants that
    agree up to a layer share one track up to it. ``base_input(k)``: the unmodified model's input of
    layer k, kept from the calibration (then no layer before the first replacement is run); None: the
    unmodified track is computed here from the embedding. ``linear(k, layer_type)``: (W, b) of layer k's
    map of that type (attention or whole block), or its calibration.taps.TapsMap (ATTN_TAPS)."""
    from nbl_gguf.calibration.apply import ATTN_DROP, replace_layer

    shape = (ids.shape[0], ids.shape[1], stream.hidden_size)
    keys = [frozenset(variant.items()) for variant in variants]
    empty = frozenset()
    tracks: dict[frozenset, torch.Tensor] = {}
    if base_input is None:
        stream.prepare_embedding(ids)
        try:
            tracks[empty] = torch.cat([stream.embed(ids[start:stop]) for start, stop in _batches(shape[0], batch_size)])
        finally:
            stream.release_embedding()
        first = 0
    else:
        first = min((layer for key in keys for layer, _ in key), default=stream.num_layers)
    for k in range(first, stream.num_layers):
        outputs = {frozenset(item for item in key if item[0] <= k) for key in keys}
        if base_input is not None:
            outputs.discard(empty)
        if not outputs:
            continue
        stream.load_layer(k)
        try:
            new_tracks = {}
            for key in sorted(outputs, key=lambda key: sorted(key)):
                source = frozenset(item for item in key if item[0] != k)
                hidden = tracks[source] if source in tracks else base_input(k)
                layer_type = dict(key).get(k)
                restore = None
                if layer_type is not None:
                    restore = replace_layer(stream.model, k, layer_type,
                                            None if layer_type == ATTN_DROP else {k: linear(k, layer_type)})
                try:
                    out = torch.empty(shape, dtype=stream.dtype, device=stream.device)
                    for start, stop in _batches(shape[0], batch_size):
                        out[start:stop] = stream.run_layer(k, hidden[start:stop])
                finally:
                    if restore is not None:
                        restore()
                new_tracks[key] = out
            tracks = new_tracks
        finally:
            stream.release_layer(k)
    return [tracks[key] if key in tracks else base_input(stream.num_layers) for key in keys]


class StreamedEvaluator:
    """Held-out loss of variants of the model (sets of replaced layers), each layer streamed once per
    call (run_variants). ``base_input(k)``: the unmodified model's input of layer k on these windows,
    kept by the calibration (None: computed from the embedding in every call). ``linear(k, type)``: the
    map of layer k."""

    def __init__(self, stream: LayerStream, heldout_ids: torch.Tensor, layer_type: int, linear, batch_size: int = 1,
                 base_input=None, min_tokens: int = MIN_HELDOUT_TOKENS):
        if heldout_ids.numel() < min_tokens:
            raise NblError(f"the held-out slice for layer selection has {heldout_ids.numel()} tokens; "
                           f"it needs at least {min_tokens} (more --selection-windows or a longer --seqlen)")
        self.stream, self.ids, self.linear, self.base_input = stream, heldout_ids, linear, base_input
        self.layer_type, self.batch_size = layer_type, max(1, batch_size)
        self.tokens = int(heldout_ids.shape[0] * (heldout_ids.shape[1] - 1))
        self.passes = 0
        stream.load_head()
        if base_input is not None:
            self.base_loss = self._loss(base_input(stream.num_layers))
        else:
            self.base_loss = self._loss(run_variants(stream, heldout_ids, [{}], linear, self.batch_size)[0])

    @classmethod
    def from_state(cls, stream: LayerStream, state, heldout_ids: torch.Tensor, layer_type: int, batch_size: int = 1,
                   taps: int = 1):
        """On the held-out windows whose every layer's input the calibration kept in ``state``; with
        ``taps`` > 1 the layers are replaced by their taps maps (layer_type ATTN_TAPS)."""
        from safetensors import safe_open

        shape = (heldout_ids.shape[0], heldout_ids.shape[1], stream.hidden_size)

        def base_input(layer: int) -> torch.Tensor:
            return HiddenStates(shape, stream.dtype, None, state.path(f"heldout-{layer}.bin"), existing=True).all()

        def linear(layer: int, _type: int):
            with safe_open(str(state.layer_tensors(layer)), framework="numpy") as handle:
                return handle.get_tensor(f"attn.{layer}.weight"), handle.get_tensor(f"attn.{layer}.bias")

        def taps_map(layer: int, _type: int):
            from nbl_gguf.calibration.taps import map_from_tensors

            with safe_open(str(state.layer_tensors(layer)), framework="numpy") as handle:
                return map_from_tensors(handle.get_tensor, layer, taps, set(handle.keys()))

        return cls(stream, heldout_ids, layer_type, linear if taps < 2 else taps_map, batch_size, base_input)

    def close(self) -> None:
        self.stream.release_head()

    def _loss(self, hidden: torch.Tensor) -> float:
        total = sum(float(self.stream.token_nll(hidden[start:stop], self.ids[start:stop]).sum())
                    for start, stop in _batches(self.ids.shape[0], self.batch_size))
        return total / self.tokens

    def losses(self, sets) -> list[float]:
        sets = [sorted(int(i) for i in s) for s in sets]
        replaced = [s for s in sets if s]
        if not replaced:
            return [self.base_loss] * len(sets)
        self.passes += 1
        finals = iter(run_variants(self.stream, self.ids, [{layer: self.layer_type for layer in s} for s in replaced],
                                   self.linear, self.batch_size, self.base_input))
        return [self._loss(next(finals)) if s else self.base_loss for s in sets]


def estimated_state_bytes(stream: LayerStream, windows: int, heldout: int, seqlen: int, targets, taps: int = 1) -> int:
    """Disk the state needs at most: two layers' worth of calibration hidden states, every layer's
    held-out input, and every layer's results (maps with and without bias, block maps)."""
    d = stream.hidden_size
    calib = 2 * tensor_bytes((windows, seqlen, d), stream.dtype)
    held = (stream.num_layers + 1) * tensor_bytes((heldout, seqlen, d), stream.dtype)
    per_layer = (2 + (1 if "block" in targets else 0)) * d * d * 4 + 8 * d * 8
    if taps > 1:  # at most the full form: taps d x d weights
        per_layer += taps * d * d * 4
    return calib + held + stream.num_layers * per_layer

